"""`python -m kvserve.service.epp`: the same as `kvserve epp`."""

from kvserve.service.epp.cli import main

main()
