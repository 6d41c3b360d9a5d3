"""`python -m kvserve.service.router`: the router with the flags of `kvserve router`."""

from kvserve.service.router.cli import main

main()
