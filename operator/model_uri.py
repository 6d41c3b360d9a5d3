"""spec.model.uri schemes, spelled as KServe's storageUri: hf://ORG/NAME[:REVISION], pvc://CLAIM/PATH,
s3://BUCKET/PATH (refused until a client ships in the image), or a bare hub id / known name."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.operator.errors import InvalidSpecError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SCHEMES = ("hf", "pvc", "s3")


@dataclass(frozen=True)
class ModelURI:
    scheme: str  # hf (hub id), pvc (weights on a claim), name (fetch-model knows it), path
    path: str  # hub id, path inside the claim, or the known name
    revision: str = "main"
    claim: str = ""  # pvc:// only

    @property
    def slug(self) -> str:
        """The folder name inside the weights cache: one per model (its revision is in the
        marker file, so a new revision replaces the old weights instead of piling up)."""
        return self.path.replace("/", "--")


def parse_model_uri(uri: str, revision: str | None = None) -> ModelURI:
    """Read a model URI; InvalidSpecError names the accepted forms."""
    scheme, sep, rest = uri.partition("://")
    if not sep:  # a local folder, a bare hub id ("org/name") or a name fetch-model knows
        if uri.startswith(("/", "./", "~")):
            return ModelURI("path", uri, revision or "main")
        kind = "hf" if _HUB_ID.match(uri) else "name"
        return ModelURI(kind, uri, revision or "main")
    if scheme == "hf":
        repo, _, rev = rest.partition(":")
        if not _HUB_ID.match(repo):
            raise InvalidSpecError(f"spec.model.uri {uri!r}: write hf://ORG/NAME[:REVISION]")
        return ModelURI("hf", repo, revision or rev or "main")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _CLAIM.match(claim):
            raise InvalidSpecError(f"spec.model.uri {uri!r}: write pvc://CLAIM/PATH with the "
                                   "name of an existing PersistentVolumeClaim")
        return ModelURI("pvc", path.strip("/"), revision or "main", claim=claim)
    if scheme == "s3":
        raise InvalidSpecError(
            f"spec.model.uri {uri!r}: s3:// is planned, not supported yet (the engine image ships "
            "no S3 client); copy the weights to a claim and use pvc://CLAIM/PATH",
            reason="UnsupportedModelURI")
    raise InvalidSpecError(f"spec.model.uri {uri!r}: unknown scheme {scheme!r} (use one of "
                           f"{', '.join(s + '://' for s in SCHEMES)} or a hub id ORG/NAME)",
                           reason="UnsupportedModelURI")
