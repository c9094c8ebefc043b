"""Write the OpenAPI document of the HTTP API into docs/openapi.json, or check that it is current.

python scripts/gen_openapi.py          # rewrite docs/openapi.json
python scripts/gen_openapi.py --check  # write nothing; exit 1 if it is stale (CI)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "docs" / "openapi.json"


def _text() -> str:
    # Imported here so that running the script from a checkout works without installing it.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlxppd.http.openapi import openapi_text

    return openapi_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if docs/openapi.json is stale"
    )
    args = parser.parse_args(argv)
    text = _text()
    current = DOCUMENT.read_text(encoding="utf-8") if DOCUMENT.exists() else None
    if current == text:
        return 0
    if args.check:
        print(
            f"{DOCUMENT.relative_to(ROOT)} is stale; run: python scripts/gen_openapi.py",
            file=sys.stderr,
        )
        return 1
    DOCUMENT.write_text(text, encoding="utf-8")
    print(f"wrote {DOCUMENT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
