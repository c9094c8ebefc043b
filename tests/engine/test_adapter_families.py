"""LoRA and DoRA adapters trained by mlx-lm's own trainer, served by 2 stages, family by family.

Each adapter is trained with ``mlx_lm.lora.train_model`` (what ``mlx_lm lora --train`` runs)
for a few iterations on pre-tokenized rows (the tiny fixtures have no tokenizer) that end in a
continuation the base model never produces, so the adapted greedy tokens differ from the
base's: every parity check below compares something. The reference is single-process mlx-lm
with ``load_adapters`` (``mlx_lm.generate --adapter-path``), on the weights held as the stages
hold them. Checked, per family: the adapter fused at load (``load_stage(adapter=)``) and kept
apart per request (``load_stage(adapters=)``, chosen with ``StageRunner.set_adapter``) both
decode like the reference, token for token; each stage reads exactly its layers' adapter
tensors; a micro-batch mixing adapters decodes every row as that row alone (MoE included,
with 32 rows, where mlx-lm's ``SwitchGLU`` sorts its entries by expert); DoRA; and the
refusals of an adapter that does not fit.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.tuner.utils import load_adapters

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.model_identity import difference
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import StageSpec, stage_specs
from mlxppd.engine.adapters import ensure_no_adapter
from mlxppd.engine.adapters import modules as adapter_modules
from mlxppd.engine.families import family_for
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import LoadedStage, load_stage
from mlxppd.engine.stage_digest import stage_identity
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.coordinator.identity_check import IdentityReference
from tests.support.adapters import as_peft
from tests.support.all_families import ALL_CASES, PROMPT
from tests.support.family_cases import CASES, KIMI_K3
from tests.support.references import load_reference_model, served_weights

N_TOKENS = 12
#: the families trained and checked in full (gemma3 as the family fixtures define it)
FAMILIES = ("llama", "qwen3", "mixtral", "deepseek_v3", "gemma3_text")
#: continuations the adapters learn: A and B, never what the random base model says
TARGET_A = [(7 * i + 100) % 256 for i in range(12)]
TARGET_B = [(13 * i + 31) % 256 for i in range(12)]
ADAPTER_FILE = "adapters.safetensors"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# -- training with mlx-lm's trainer ------------------------------------------------------------


class _Rows:
    """Pre-tokenized rows in the dataset shape mlx-lm's trainer takes (``process`` gives
    (tokens, prompt offset), as its TextDataset does)."""

    def __init__(self, rows: list[list[int]]):
        self._rows = rows

    def __getitem__(self, index: int) -> list[int]:
        return self._rows[index]

    def __len__(self) -> int:
        return len(self._rows)

    def process(self, row: list[int]) -> tuple[list[int], int]:
        return row, 0


def train(
    model_dir: Path,
    out: Path,
    target: list[int],
    *,
    kind: str = "lora",
    num_layers: int = -1,
    iters: int = 4,
    learning_rate: float = 3e-3,
    rank: int = 4,
) -> Path:
    """An adapter trained by ``mlx_lm.lora.train_model`` to continue prompts with ``target``;
    returns its directory (``adapter_config.json`` and ``adapters.safetensors``)."""
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model

    rows = [PROMPT[: 10 + 5 * j] + target for j in range(4)]
    args = types.SimpleNamespace(**{
        **CONFIG_DEFAULTS,
        "model": str(model_dir), "train": True, "fine_tune_type": kind, "num_layers": num_layers,
        "batch_size": 2, "iters": iters, "val_batches": 1, "learning_rate": learning_rate,
        "steps_per_report": iters, "steps_per_eval": 10**6, "save_every": 10**6,
        "adapter_path": str(out), "seed": 0,
        "lora_parameters": {"rank": rank, "dropout": 0.0, "scale": 20.0},
    })  # fmt: skip
    model = load_reference_model(model_dir)
    state = np.random.get_state()
    np.random.seed(0)  # the trainer shuffles its batches with numpy's global generator
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train_model(args, model, _Rows(rows), _Rows(rows))
    finally:
        np.random.set_state(state)
    return out


@pytest.fixture(scope="module")
def trained(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, Path]]:
    """``trained(family, tag="a", **train_args)`` -> (model dir, adapter dir), made once."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(family: str, tag: str = "a", **kwargs: Any) -> tuple[Path, Path]:
        if (family, tag) not in made:
            config, bits, _ = ALL_CASES.get(family) or (KIMI_K3, None, ())
            model_dir = tiny_model(f"family-{family}", config, quantize_bits=bits)
            target = TARGET_B if tag.startswith("b") else TARGET_A
            out = tmp_path_factory.mktemp(f"adapter-{family}-{tag}")
            made[(family, tag)] = (model_dir, train(model_dir, out, target, **kwargs))
        return made[(family, tag)]

    return make


# -- references and runs -----------------------------------------------------------------------


def mlx_lm_model(
    model_dir: Path, adapter: Path | None, *, fuse: bool = False, weights: CpuWeights | None = None
) -> Any:
    """Single-process mlx-lm with ``adapter`` (``load_adapters``); ``fuse``: then fused as
    ``mlx_lm fuse`` does (a quantized base quantized again)."""
    model = load_reference_model(model_dir, *(() if weights is None else (weights,)))
    if adapter is not None:
        load_adapters(model, str(adapter))
        model.eval()
    if fuse:
        fused = [
            (n, m.fuse(dequantize=False)) for n, m in model.named_modules() if hasattr(m, "fuse")
        ]
        model.update_modules(tree_unflatten(fused))
    return model


def greedy(model: Any, prompt: Sequence[int] = PROMPT, n: int = N_TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(list(prompt)), model, max_tokens=n)]


def two_stages(model_dir: Path, family: str, weights: CpuWeights | None = None,
               **adapters: Any) -> list[LoadedStage]:  # fmt: skip
    """The family's first split (2 stages; 1 for a single-process family), held as served."""
    config, _, splits = ALL_CASES.get(family) or (KIMI_K3, None, ("0-3",))
    n_layers = family_for(config).num_layers(config)
    mode = served_weights(model_dir) if weights is None else weights
    specs = stage_specs(parse_pp_layers(splits[0], n_layers))
    return [load_stage(model_dir, spec, weights_mode=mode, **adapters) for spec in specs]


def quantized(stages: list[LoadedStage]) -> bool:
    kinds = (nn.QuantizedLinear, QuantizedSwitchLinear)
    return any(isinstance(m, kinds) for s in stages for _, m in s.net.model.named_modules())


def _pass(runners: list[StageRunner], seq: str, tokens: list[int], sample: bool) -> int | None:
    h = mx.array(tokens, dtype=mx.uint32)[None]
    for runner in runners[:-1]:
        h = runner.forward(seq, h)
    if not sample:
        runners[-1].forward(seq, h)
        return None
    return runners[-1].forward_and_sample(seq, h, False).token


def _prefill(
    runners: list[StageRunner], seq: str, prompt: Sequence[int], adapter: str | None
) -> int:
    """As mlx-lm's ``generate_step``: all but the last prompt token, then the first token."""
    for runner in runners:
        runner.set_adapter(seq, adapter)
    _pass(runners, seq, list(prompt[:-1]), sample=False)
    token = _pass(runners, seq, list(prompt[-1:]), sample=True)
    assert token is not None
    return token


def runner_greedy(
    runners: list[StageRunner], adapter: str | None, prompt: Sequence[int] = PROMPT,
    n: int = N_TOKENS, seq: str = "one",
) -> list[int]:  # fmt: skip
    """One sequence through the stages' runners, running per-request adapter ``adapter``."""
    tokens = [_prefill(runners, seq, prompt, adapter)]
    while len(tokens) < n:
        token = _pass(runners, seq, tokens[-1:], sample=True)
        assert token is not None
        tokens.append(token)
    for runner in runners:
        runner.release(seq)
    return tokens


def group_greedy(
    runners: list[StageRunner], prompts: list[list[int]], adapters: list[str | None],
    n: int = N_TOKENS,
) -> list[list[int]]:  # fmt: skip
    """Each sequence prefilled alone, then decoded in one micro-batch (``forward_group``)."""
    seqs = [f"row{i}" for i in range(len(prompts))]
    out = [[_prefill(runners, s, p, a)] for s, p, a in zip(seqs, prompts, adapters, strict=True)]
    for _ in range(n - 1):
        h = mx.array([row[-1:] for row in out], dtype=mx.uint32)
        for runner in runners[:-1]:
            h = runner.forward_group("mixed", seqs, h)
        sampled = runners[-1].forward_group_and_sample("mixed", seqs, h, False)
        for row, s in zip(out, sampled, strict=True):
            row.append(s.token)
    for runner in runners:
        runner.release_all()
    return out


def file_tensors(adapter: Path) -> list[str]:
    loaded = mx.load(str(adapter / ADAPTER_FILE))
    assert isinstance(loaded, dict)
    return sorted(loaded)


def assert_reads_own_layers(stages: list[LoadedStage], adapter: Path, name: str | None) -> None:
    """Each stage read exactly the file's tensors of its own layers; together, all of them."""
    names = file_tensors(adapter)
    assert all(_LAYER.search(n) for n in names), "an adapter tensor outside the layers"
    for stage in stages:
        assert stage.adapters is not None
        info = stage.adapters.fused if name is None else stage.adapters.named[name]
        assert info is not None
        own = [n for n in names if stage.spec.owns_layer(int(_LAYER.search(n).group(1)))]  # type: ignore[union-attr]
        assert (info.read, info.stored) == (len(own), len(names)), stage.spec
        assert info.modules == sum(n.endswith(".lora_a") for n in own)
    total = 0
    for stage in stages:
        assert stage.adapters is not None
        info = stage.adapters.fused if name is None else stage.adapters.named[name]
        assert info is not None
        total += info.read
    assert total == len(names)


# -- every family checked in full --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_with_an_adapter_decode_like_mlx_lm(
    trained: Callable[..., tuple[Path, Path]], family: str
) -> None:
    model_dir, adapter = trained(family)
    base = greedy(mlx_lm_model(model_dir, None))
    want = greedy(mlx_lm_model(model_dir, adapter))
    assert sum(a != b for a, b in zip(base, want, strict=True)) >= N_TOKENS // 2, (
        "the adapter hardly changes the output: the parity below would be vacuous"
    )

    fused = two_stages(model_dir, family, adapter=adapter)
    assert len(fused) == 2
    # mlx-lm fusing into a quantized base quantizes it again (``mlx_lm fuse``): the same here
    fused_want = greedy(mlx_lm_model(model_dir, adapter, fuse=True)) if quantized(fused) else want
    assert [s.token for s in InProcessPipeline(fused).generate(PROMPT, N_TOKENS)] == fused_want
    assert_reads_own_layers(fused, adapter, None)

    kept = two_stages(model_dir, family, adapters={"a": adapter})
    runners = [StageRunner(stage) for stage in kept]
    assert runner_greedy(runners, "a") == want
    assert runner_greedy(runners, None) == base  # the same stages still serve the base model
    assert_reads_own_layers(kept, adapter, "a")


def test_a_peft_adapter_is_read_as_the_same_adapter(
    trained: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    """The same adapter in PEFT's layout (lora_A/lora_B transposed, alpha = scale x r)."""
    model_dir, adapter = trained("llama")
    peft = as_peft(adapter, tmp_path / "peft")
    want = greedy(mlx_lm_model(model_dir, adapter))
    fused = two_stages(model_dir, "llama", adapter=peft)
    assert [s.token for s in InProcessPipeline(fused).generate(PROMPT, N_TOKENS)] == want
    kept = two_stages(model_dir, "llama", adapters={"p": peft})
    assert runner_greedy([StageRunner(stage) for stage in kept], "p") == want


def test_dora_on_llama_fused_and_per_request_decode_like_mlx_lm(
    trained: Callable[..., tuple[Path, Path]], row_masks: list[bool]
) -> None:
    model_dir, adapter = trained("llama", "a-dora", kind="dora")
    assert json.loads((adapter / "adapter_config.json").read_text())["fine_tune_type"] == "dora"
    assert any(n.endswith(".m") for n in file_tensors(adapter))
    base = greedy(mlx_lm_model(model_dir, None))
    want = greedy(mlx_lm_model(model_dir, adapter))
    assert sum(a != b for a, b in zip(base, want, strict=True)) >= N_TOKENS // 2

    fused = two_stages(model_dir, "llama", adapter=adapter)
    assert {s.adapters.fused.kind for s in fused if s.adapters and s.adapters.fused} == {"dora"}
    assert [s.token for s in InProcessPipeline(fused).generate(PROMPT, N_TOKENS)] == want
    assert_reads_own_layers(fused, adapter, None)

    runners = [StageRunner(s) for s in two_stages(model_dir, "llama", adapters={"d": adapter})]
    assert runner_greedy(runners, "d") == want
    assert runner_greedy(runners, None) == base
    # DoRA rows beside base rows in one micro-batch
    prompts = [list(PROMPT), list(PROMPT[3:]), list(PROMPT[:33])]
    choice: list[str | None] = ["d", None, "d"]
    alone = [runner_greedy(runners, a, p) for a, p in zip(choice, prompts, strict=True)]
    assert alone[0] != runner_greedy(runners, None, prompts[0])
    assert group_greedy(runners, prompts, choice) == alone
    assert row_masks, "the rows never ran in one batch"


def test_quantized_experts_in_native_weights(trained: Callable[..., tuple[Path, Path]]) -> None:
    """Mixtral as its 4-bit checkpoint stores it (whatever this host serves by default): the
    fused adapter equals ``mlx_lm fuse``'s model, the per-request one mlx-lm's LoRA layers over
    QuantizedSwitchLinear."""
    model_dir, adapter = trained("mixtral")
    native = CpuWeights.NATIVE
    fused = two_stages(model_dir, "mixtral", native, adapter=adapter)
    assert quantized(fused)
    want_fused = greedy(mlx_lm_model(model_dir, adapter, fuse=True, weights=native))
    assert [s.token for s in InProcessPipeline(fused).generate(PROMPT, N_TOKENS)] == want_fused

    want = greedy(mlx_lm_model(model_dir, adapter, weights=native))
    assert want != greedy(mlx_lm_model(model_dir, None, weights=native))
    runners = [
        StageRunner(s) for s in two_stages(model_dir, "mixtral", native, adapters={"a": adapter})
    ]
    assert runner_greedy(runners, "a") == want


def test_an_adapter_of_the_last_layers_only_is_read_by_their_stage(
    trained: Callable[..., tuple[Path, Path]],
) -> None:
    model_dir, adapter = trained("llama", "a-last2", num_layers=2)
    assert {int(_LAYER.search(n).group(1)) for n in file_tensors(adapter)} == {2, 3}  # type: ignore[union-attr]
    stages = two_stages(model_dir, "llama", adapter=adapter)
    assert [s.adapters.fused.read for s in stages if s.adapters and s.adapters.fused] == [0, 28]
    assert_reads_own_layers(stages, adapter, None)
    want = greedy(mlx_lm_model(model_dir, adapter))
    assert [s.token for s in InProcessPipeline(stages).generate(PROMPT, N_TOKENS)] == want


# -- micro-batches mixing adapters -------------------------------------------------------------


@pytest.fixture()
def row_masks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each per-row mask the adapted modules build (its ``sorted_rows``): a pass mixing
    adapters in one batch builds some; rows run one by one build none."""
    calls: list[bool] = []
    row_mask = adapter_modules._row_mask

    def spy(bank: Any, name: str, y: mx.array, sorted_rows: bool) -> mx.array:
        calls.append(sorted_rows)
        return row_mask(bank, name, y, sorted_rows)

    monkeypatch.setattr(adapter_modules, "_row_mask", spy)
    return calls


def _prompts(rows: int) -> list[list[int]]:
    """Distinct prompts of one length (no padding in the batched caches)."""
    return [[(t + 17 * i) % 250 + 3 for t in PROMPT[:24]] for i in range(rows)]


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_a_micro_batch_mixing_adapters_decodes_each_row_as_alone(
    trained: Callable[..., tuple[Path, Path]], row_masks: list[bool], family: str
) -> None:
    model_dir, adapter_a = trained(family)
    _, adapter_b = trained(family, "b")
    runners = [
        StageRunner(s)
        for s in two_stages(model_dir, family, adapters={"a": adapter_a, "b": adapter_b})
    ]
    prompts = [PROMPT, PROMPT[5:], PROMPT[:30]]  # different lengths: left-padded caches
    base = [runner_greedy(runners, None, p) for p in prompts]
    for choice in (["a", None, "b"], [None, "a", "b"], ["b", "a", "a"]):
        alone = [runner_greedy(runners, a, p) for a, p in zip(choice, prompts, strict=True)]
        for a, row, base_row in zip(choice, alone, base, strict=True):
            assert (row != base_row) == (a is not None), "an adapter that changes nothing"
        row_masks.clear()
        assert group_greedy(runners, [list(p) for p in prompts], list(choice)) == alone, choice
        assert row_masks, "the rows never ran in one batch"
    # and the rows equal mlx-lm's own answers with those adapters
    refs = {a: mlx_lm_model(model_dir, d) for a, d in (("a", adapter_a), ("b", adapter_b))}
    refs[None] = mlx_lm_model(model_dir, None)  # type: ignore[index]
    for a, p in zip(["a", None, "b"], prompts, strict=True):
        assert runner_greedy(runners, a, p) == greedy(refs[a], p)  # type: ignore[index]


def test_32_moe_rows_sorted_by_expert_keep_their_adapters(
    trained: Callable[..., tuple[Path, Path]], row_masks: list[bool]
) -> None:
    """32 decode rows x top-2 = 64 routing entries: mlx-lm's SwitchGLU sorts them by expert,
    so the expert layers see rows out of order; each row must still get its own adapter."""
    assert ALL_CASES["mixtral"][0]["num_experts_per_tok"] == 2
    model_dir, adapter_a = trained("mixtral")
    _, adapter_b = trained("mixtral", "b")
    stages = two_stages(model_dir, "mixtral", adapters={"a": adapter_a, "b": adapter_b})
    runners = [StageRunner(s) for s in stages]
    rows = 32
    choice: list[str | None] = [("a", None, "b", "a", None)[i % 5] for i in range(rows)]
    prompts = _prompts(rows)
    got = group_greedy(runners, prompts, choice, n=8)
    assert any(row_masks), "the expert layers never ran sorted: the case is not exercised"

    refs = {None: mlx_lm_model(model_dir, None), "a": mlx_lm_model(model_dir, adapter_a),
            "b": mlx_lm_model(model_dir, adapter_b)}  # fmt: skip
    want = [greedy(refs[c], p, 8) for c, p in zip(choice, prompts, strict=True)]
    assert got == want
    # the adapters matter for these rows: a mask on the wrong rows would show
    base = [greedy(refs[None], p, 8) for p in prompts]
    assert sum(w != b for w, b, c in zip(want, base, choice, strict=True) if c) >= rows // 2


# -- which families take mlx-lm's LoRA ---------------------------------------------------------

SWEEP = sorted(set(ALL_CASES) - set(FAMILIES)) + ["kimi_k3"]


@pytest.mark.parametrize("family", SWEEP)
def test_every_family_takes_mlx_lm_lora_conversion(
    trained: Callable[..., tuple[Path, Path]], family: str
) -> None:
    """mlx-lm's trainer converts every family's fixture (``linear_to_lora_layers``); its
    adapter loads on the stages, fused and per request, and decodes like mlx-lm."""
    config = ALL_CASES[family][0] if family in ALL_CASES else KIMI_K3
    assert getattr(family_for(config), "ADAPTER_REFUSAL", None) is None
    model_dir, adapter = trained(family, iters=2)
    want = greedy(mlx_lm_model(model_dir, adapter), n=8)
    assert want != greedy(mlx_lm_model(model_dir, None), n=8)

    fused = two_stages(model_dir, family, adapter=adapter)
    fused_want = (
        greedy(mlx_lm_model(model_dir, adapter, fuse=True), n=8) if quantized(fused) else want
    )
    assert [s.token for s in InProcessPipeline(fused).generate(PROMPT, 8)] == fused_want
    assert_reads_own_layers(fused, adapter, None)
    runners = [StageRunner(s) for s in two_stages(model_dir, family, adapters={"a": adapter})]
    assert runner_greedy(runners, "a", n=8) == want


# -- refusals ----------------------------------------------------------------------------------


def test_an_adapter_trained_on_another_model_is_refused(
    trained: Callable[..., tuple[Path, Path]], tiny_model: Callable[..., Path]
) -> None:
    _, adapter = trained("llama")
    wide = tiny_model(
        "llama-wide", {**CASES["llama"][0], "hidden_size": 96, "num_attention_heads": 6}
    )
    spec = StageSpec(0, 2, 0, 2)
    with pytest.raises(ConfigurationError) as caught:
        load_stage(wide, spec, adapter=adapter)
    assert str(caught.value) == (
        f"{adapter}: its model.layers.0.mlp.down_proj.lora_b has shape (4, 64), the model's "
        "(4, 96); was it trained on another model?"
    )
    # per request: all or nothing, the model is left as it was
    stage = load_stage(wide, spec)
    assert stage.adapters is not None
    with pytest.raises(ConfigurationError, match="was it trained on another model"):
        stage.adapters.load("a", adapter)
    assert stage.adapters.named == {}
    assert not any(hasattr(m, "_mlxpp_bank") for _, m in stage.net.model.named_modules())

    mixtral_dir, _ = trained("mixtral")
    with pytest.raises(ConfigurationError) as caught:
        load_stage(mixtral_dir, spec, adapter=adapter)
    assert str(caught.value) == (
        "--adapter: adapts model.layers.0.mlp.down_proj, which model_type 'mixtral' does not "
        "have; was it trained on another model?"
    )


def test_a_refused_reload_keeps_the_adapter_of_that_name_running(
    trained: Callable[..., tuple[Path, Path]], tiny_model: Callable[..., Path]
) -> None:
    """Loading a bad file under a name in use leaves the one held before, as it was."""
    model_dir, adapter = trained("llama")
    _, other = trained("mixtral")  # adapts modules this llama does not have
    stages = two_stages(model_dir, "llama")
    runners = [StageRunner(stage) for stage in stages]
    for stage in stages:
        assert stage.adapters is not None
        stage.adapters.load("a", adapter)
    before = runner_greedy(runners, "a")
    for stage in stages:
        assert stage.adapters is not None
        with pytest.raises(ConfigurationError, match="does not have"):
            stage.adapters.load("a", other)
        assert stage.adapters.named["a"].path == str(adapter)
    assert runner_greedy(runners, "a") == before == greedy(mlx_lm_model(model_dir, adapter))


def test_a_dora_adapter_on_moe_experts_is_refused(
    trained: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    """mlx-lm has no DoRA for SwitchLinear (its trainer refuses to make one); a DoRA file
    naming expert layers (from elsewhere) is refused in one sentence, fused or per request."""
    model_dir, lora = trained("mixtral")
    dora = tmp_path / "mixtral-dora"
    shutil.copytree(lora, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    sentence = (
        "--adapter: model_type 'mixtral' cannot take this adapter on "
        "model.layers.2.block_sparse_moe.switch_mlp.down_proj ({cls}): mlx-lm has no DoRA for "
        "MoE expert layers"
    )
    spec = StageSpec(1, 2, 2, 4)
    for weights, cls in (
        (CpuWeights.NATIVE, "QuantizedSwitchLinear"),
        (CpuWeights.FLOAT32, "SwitchLinear"),
    ):
        with pytest.raises(ConfigurationError) as caught:
            load_stage(model_dir, spec, weights_mode=weights, adapter=dora)
        assert str(caught.value) == sentence.format(cls=cls)
        with pytest.raises(ConfigurationError) as caught:
            load_stage(model_dir, spec, weights_mode=weights, adapters={"d": dora})
        assert str(caught.value) == sentence.format(cls=cls)


def test_a_family_marked_unable_is_refused_in_one_sentence() -> None:
    """No family sets ``ADAPTER_REFUSAL`` today (every one converts, above); one that does is
    refused before any adapter tensor is read."""

    class Unable:
        ADAPTER_REFUSAL = "its layers are not linear"

    with pytest.raises(ConfigurationError) as caught:
        ensure_no_adapter(Unable(), {"model_type": "x"})
    assert str(caught.value) == (
        "--adapter: model_type 'x' cannot run LoRA adapters: its layers are not linear"
    )
    ensure_no_adapter(family_for(CASES["llama"][0]), CASES["llama"][0])


def test_a_stage_with_another_adapter_file_is_refused_by_the_identity_check(
    trained: Callable[..., tuple[Path, Path]],
) -> None:
    """The coordinator's expected identity carries the digest of its copy of the adapter over
    each stage's layers; a stage that loaded another file differs, in one sentence."""
    model_dir, adapter = trained("llama")
    _, other = trained("llama", tag="b")
    config = read_model_config(model_dir)
    for stage in two_stages(model_dir, "llama", adapter=other):
        assert stage.adapters is not None
        actual = stage_identity(model_dir, stage.spec, config).model_copy(
            update={"adapters": dict(stage.adapters.digests())}
        )
        same = IdentityReference(model_dir, config, adapters=lambda: {"": other})
        assert difference(same.expected(stage.spec), actual) is None
        cluster = IdentityReference(model_dir, config, adapters=lambda: {"": adapter})
        found = difference(cluster.expected(stage.spec), actual)
        assert found is not None and found.startswith("its fused adapter differs: sha256 ")
