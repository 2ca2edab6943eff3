"""Who calls the controller: the cluster token (the operator and the workers) or a tenant's token.

Contract:
- `TenantTokens.load(path)` reads a YAML (or JSON) mapping of tenant name -> token, for example
  `{acme: "<token>", acme-staging: "<same token>"}`: a token listed under several tenants acts for all of them.
  A missing, unreadable or malformed file, an empty token or one equal to the cluster token is a `ValueError`
  of one line; a file that others than its owner may read is a logged warning (it holds secrets).
- `identify(given)` compares the given credential with every token in constant time and answers a `Caller`:
  the cluster token is `Caller.ADMIN` (every route, every namespace); a tenant token is a caller scoped to its
  tenants; anything else is None (401).
- A tenant is a vLLM request's `cache_salt` (or the reference engine's `salt`): its chunks live under
  `KeySpace.tenant(name)` of each instance's namespace, which the controller derives from the namespace's wire
  form. What a tenant caller may do is decided in `controller_service` / `controller_app`, not here.
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: the operator (`is_admin`) or the tenants one token acts for."""
    is_admin: bool
    tenants: frozenset[str] = frozenset()
    ADMIN: ClassVar[Caller]


Caller.ADMIN = Caller(is_admin=True)


@dataclass(frozen=True, slots=True)
class TenantTokens:
    """Tenant tokens: token -> the tenants it acts for."""
    tenants_of: tuple[tuple[str, frozenset[str]], ...] = ()

    @classmethod
    def load(cls, path: str | os.PathLike, cluster_token: str | None) -> TenantTokens:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
            mode = path.stat().st_mode
        except OSError as exc:
            raise ValueError(f"tenant tokens file {str(path)!r}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"tenant tokens file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}"
                             ) from None
        if not isinstance(data, dict) or not data:
            raise ValueError(f"tenant tokens file {str(path)!r}: expected a mapping of tenant name -> token")
        if not cluster_token:
            raise ValueError("tenant tokens need the cluster token too (--token-file or $KVFABRIC_CLUSTER__TOKEN): "
                             "without it every caller may do everything")
        tenants: dict[str, set[str]] = {}
        for tenant, token in data.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"tenant tokens file {str(path)!r}: tenant names are strings (quote {tenant!r})")
            if not isinstance(token, str) or not token.strip():
                raise ValueError(f"tenant tokens file {str(path)!r}: tenant {tenant!r} needs a non-empty token")
            if hmac.compare_digest(token.strip().encode(), cluster_token.encode()):
                raise ValueError(f"tenant tokens file {str(path)!r}: tenant {tenant!r} has the cluster token")
            tenants.setdefault(token.strip(), set()).add(tenant)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("tenant tokens file %s is mode %o: others than its owner may read the tokens "
                        "(chmod 600 %s)", path, stat.S_IMODE(mode), path)
        return cls(tuple((token, frozenset(names)) for token, names in tenants.items()))

    def identify(self, given: bytes, cluster_token: str | None) -> Caller | None:
        """The caller `given` authenticates (every token compared, in constant time each), else None."""
        if cluster_token is None:
            return Caller.ADMIN  # no token configured: an open controller (loopback only, see check_bind)
        found = Caller.ADMIN if hmac.compare_digest(given, cluster_token.encode()) else None
        for token, tenants in self.tenants_of:
            if hmac.compare_digest(given, token.encode()):
                found = Caller(is_admin=False, tenants=tenants)
        return found
