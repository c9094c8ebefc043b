"""Write the JSON Schemas of the TOML files into schemas/, or check that they are current.

python scripts/gen_schemas.py          # rewrite schemas/*.schema.json
python scripts/gen_schemas.py --check  # exit 1 and name the stale files (CI)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generators() -> dict[Path, Callable[[], str]]:
    # Imported here so that running the script from a checkout works without installing it.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlxppd.core.config.cluster import cluster_json_schema_text
    from mlxppd.core.config.host import host_json_schema_text

    return {
        ROOT / "schemas" / "cluster.schema.json": cluster_json_schema_text,
        ROOT / "schemas" / "mlxppd.schema.json": host_json_schema_text,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a schema file is stale"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, generate in _generators().items():
        text = generate()
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(
            f"{path.relative_to(ROOT)} is stale; run: python scripts/gen_schemas.py",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
