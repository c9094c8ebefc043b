"""Every pipeline family's tiny case, and the prompt the family tests give them.

``ALL_CASES`` joins ``family_cases`` and ``family_cases_boundaries`` (same format), with the
VLM cases' ``{"__from__": name}`` text configs filled in from the case they name.
"""

from __future__ import annotations

from tests.support.family_cases import CASES, Case, resolve_text_configs
from tests.support.family_cases_boundaries import CASES as BOUNDARY_CASES

ALL_CASES: dict[str, Case] = {**CASES, **BOUNDARY_CASES}
resolve_text_configs(ALL_CASES, ALL_CASES)
#: 40 token ids, longer than any case's sliding window
PROMPT = [(11 * i + 5) % 200 + 3 for i in range(40)]
