"""Write the OpenAPI documents of the HTTP API (docs/openapi.json) and of the admin API
(docs/admin-openapi.json), or check that they are current.

python scripts/gen_openapi.py          # rewrite both
python scripts/gen_openapi.py --check  # write nothing; exit 1 if either is stale (CI)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "docs" / "openapi.json"
ADMIN_DOCUMENT = ROOT / "docs" / "admin-openapi.json"


def _documents() -> dict[Path, Callable[[], str]]:
    # Imported here so that running the script from a checkout works without installing it.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlxppd.http.admin_openapi import admin_openapi_text
    from mlxppd.http.openapi import openapi_text

    return {DOCUMENT: openapi_text, ADMIN_DOCUMENT: admin_openapi_text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a document is stale"
    )
    args = parser.parse_args(argv)
    stale = 0
    for path, text_of in _documents().items():
        text = text_of()
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            print(
                f"{path.relative_to(ROOT)} is stale; run: python scripts/gen_openapi.py",
                file=sys.stderr,
            )
            stale = 1
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
