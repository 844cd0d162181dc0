"""``python -m gateway.keys TENANT [NAME]``: make a new API key for a tenant.

Prints the key (give it to the client; it is not stored) and the ``[[gateway.api_keys]]``
entry to add to the settings file, which holds only the key's SHA-256.
"""

from __future__ import annotations

import secrets
import sys

from schemas import is_token

from .auth import key_hash


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or not is_token(argv[0]):
        print("usage: python -m gateway.keys TENANT [NAME]  (TENANT: 1-64 of A-Z a-z 0-9 _ -)")
        return 2
    tenant, name = argv[0], argv[1] if len(argv) == 2 else ""
    key = "lm_" + secrets.token_urlsafe(32)
    print(f"API key (shown once): {key}\n")
    print("[[gateway.api_keys]]")
    print(f'sha256 = "{key_hash(key)}"')
    print(f'tenant = "{tenant}"')
    if name:
        print(f'name = "{name}"')
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
