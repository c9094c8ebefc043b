"""What an adapter directory, an ``--adapter`` flag and the TOML's adapters may say, and how
the coordinator keeps them apart (prompt cache, drain, identity)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from mlxppd.core.adapters import adapter_config, parse_adapter_flag, tensor_name
from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.model_identity import StageIdentity, difference
from mlxppd.core.prompt_cache import PromptIndex
from mlxppd.runtime.backends.contract import RequestRefused
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry

MLX = {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": {"rank": 8, "scale": 20.0}}


def test_a_flag_is_a_fused_directory_or_a_named_one() -> None:
    assert parse_adapter_flag("/a/b") == (None, "/a/b")
    assert parse_adapter_flag("pirate=/a/b=c") == ("pirate", "/a/b=c")
    with pytest.raises(ConfigurationError, match="is not an adapter name"):
        parse_adapter_flag("b/d=/x")
    with pytest.raises(ConfigurationError, match="names no directory; use NAME=DIR"):
        parse_adapter_flag("pirate=")


def test_mlx_lm_and_peft_configs_give_rank_scale_and_kind() -> None:
    mlx = adapter_config(MLX, {"adapters.safetensors"}, "c.json")
    assert (mlx.kind, mlx.rank, mlx.scale, mlx.naming) == ("lora", 8, 20.0, "mlx")
    peft = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True}
    got = adapter_config(peft, {"adapter_model.safetensors"}, "c.json")
    assert (got.kind, got.rank, got.scale, got.naming) == ("dora", 8, 2.0, "peft")
    rs = adapter_config({**peft, "use_rslora": True}, {"adapter_model.safetensors"}, "c.json")
    assert rs.scale == pytest.approx(16 / 8**0.5)


@pytest.mark.parametrize(
    ("data", "files", "says"),
    [
        ({**MLX, "fine_tune_type": "full"}, {"adapters.safetensors"}, "fuse it with `mlx_lm fuse`"),
        ({"fine_tune_type": "lora"}, {"adapters.safetensors"}, "has no lora_parameters"),
        ({**MLX, "lora_parameters": {"rank": 0, "scale": 1}}, set(), "rank = 0 is not a number"),
        (MLX, set(), "has no adapters.safetensors beside it"),
        ({"peft_type": "IA3", "r": 8}, {"adapter_model.safetensors"}, "is not a LoRA adapter"),
        ({"peft_type": "LORA", "r": 8, "lora_alpha": 8}, set(), "needs adapter_model.safetensors"),
        ([1, 2], set(), "is not a JSON object"),
        (
            {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "alpha_pattern": {"q_proj": 4}},
            {"adapter_model.safetensors"},
            "alpha_pattern gives some modules their own",
        ),
    ],
)
def test_a_bad_adapter_config_is_one_sentence_naming_the_file(
    data: object, files: set[str], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=".") as refused:
        adapter_config(data, files, "/ad/adapter_config.json")
    assert str(refused.value).startswith("/ad/adapter_config.json") and says in str(refused.value)


def test_tensor_names_map_to_mlx_lm_modules() -> None:
    mlx = tensor_name("model.layers.3.self_attn.q_proj.lora_a", "mlx")
    assert mlx is not None and (mlx.module, mlx.leaf, mlx.transpose) == (
        "model.layers.3.self_attn.q_proj", "lora_a", False,
    )  # fmt: skip
    peft = tensor_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight", "peft")
    assert peft is not None and (peft.module, peft.leaf, peft.transpose) == (
        "model.layers.3.mlp.up_proj", "lora_b", True,
    )  # fmt: skip
    magnitude = tensor_name("base_model.model.model.layers.0.o_proj.lora_magnitude_vector", "peft")
    assert magnitude is not None and (magnitude.leaf, magnitude.transpose) == ("m", False)
    assert tensor_name("model.layers.3.self_attn.q_proj.weight", "mlx") is None


TOML = """
[cluster]
pipeline_parallel_size = 2
adapter = "/srv/fused"

[[nodes]]
id = "c"
address = "10.0.0.1:9000"
role = "hybrid"

[[nodes]]
id = "s0"
address = "10.0.0.2:9000"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "s1"
address = "10.0.0.3:9000"
role = "pipeline_stage"
stage = 1
"""


def test_the_toml_takes_a_fused_adapter_and_named_ones_and_renders_them() -> None:
    text = TOML + '\n[[adapters]]\nname = "pirate"\npath = "/srv/pirate"\n'
    cfg = parse_cluster_config(text, "cluster.toml")
    assert cfg.cluster.adapter == "/srv/fused"
    assert [(a.name, a.path) for a in cfg.adapters] == [("pirate", "/srv/pirate")]
    assert parse_cluster_config(render_cluster_toml(cfg), "again") == cfg


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('\n[[adapters]]\nname = "a"\npath = "/x"\n[[adapters]]\nname = "a"\npath = "/y"\n',
         "two [[adapters]] are named 'a'"),
        ('\n[[adapters]]\nname = "a b"\npath = "/x"\n', "is not an adapter name"),
        ('\n[[adapters]]\nname = "a"\npth = "/x"\n', "pth"),
    ],
)  # fmt: skip
def test_bad_adapters_in_the_toml_name_the_key(extra: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        parse_cluster_config(TOML + extra, "cluster.toml")
    assert "cluster.toml" in str(refused.value) and says in str(refused.value)


def test_adapters_are_refused_on_tensor_parallel_stages() -> None:
    nodes = "".join(
        f'\n[[nodes]]\nid = "s{stage}r{rank}"\naddress = "10.0.1.{2 * stage + rank}:9000"\n'
        f'role = "pipeline_tensor_parallel"\nstage = {stage}\nrank = {rank}\n'
        for stage in (0, 1)
        for rank in (0, 1)
    )
    text = (
        '[cluster]\npipeline_parallel_size = 2\ntensor_parallel_size = 2\nadapter = "/srv/a"\n'
        '\n[[nodes]]\nid = "c"\naddress = "10.0.0.1:9000"\nrole = "hybrid"\n' + nodes
    )
    with pytest.raises(ConfigurationError, match="adapters run on stages of one rank"):
        parse_cluster_config(text, "cluster.toml")
    parse_cluster_config(text.replace('adapter = "/srv/a"\n', ""), "cluster.toml")


def _identity(adapters: dict[str, str]) -> StageIdentity:
    return StageIdentity(
        config_sha256="a" * 64, family="llama", quantization="none", layers=(0, 2),
        tensors_sha256="b" * 64, tensors=4, nbytes=16, adapters=adapters,
    )  # fmt: skip


def test_a_stage_with_another_adapter_file_is_not_the_clusters_stage() -> None:
    cluster = _identity({"": "1" * 64, "pirate": "2" * 64})
    assert difference(cluster, _identity({"": "1" * 64, "pirate": "2" * 64})) is None
    assert "fused adapter differs: sha256 3333" in str(
        difference(cluster, _identity({"": "3" * 64, "pirate": "2" * 64}))
    )
    assert "has no fused adapter" in str(difference(cluster, _identity({"pirate": "2" * 64})))
    assert "adapter 'pirate' differs" in str(
        difference(cluster, _identity({"": "1" * 64, "pirate": "4" * 64}))
    )
    # A named adapter a restarted stage does not hold yet is loaded again, not a mismatch.
    assert difference(cluster, _identity({"": "1" * 64})) is None


def test_a_kept_prompt_is_reused_only_by_requests_of_the_same_adapter() -> None:
    index = PromptIndex(8, min_reuse=2)
    index.add("base", [1, 2, 3, 4, 5])
    index.add("pirate", [1, 2, 3, 4, 5], "pirate")
    found = index.match([1, 2, 3, 4, 5, 6], "pirate")
    assert found is not None and found.entry == "pirate"
    base = index.match([1, 2, 3, 4, 5, 6])
    assert base is not None and base.entry == "base"
    assert index.match([1, 2, 3, 4, 5, 6], "robot") is None
    assert index.forget_tag("pirate") == ["pirate"] and len(index) == 1


def test_an_unload_drains_its_adapter_alone() -> None:
    async def scenario() -> None:
        registry = AdapterRegistry(None, {"a": Path("/a"), "b": Path("/b")})
        assert registry.chosen("a") == "a" and registry.chosen("base-model") is None
        registry.begin("a")
        registry.begin("b")
        drained = asyncio.ensure_future(registry.drain("a", 60))
        await asyncio.sleep(0)
        assert registry.names() == ["b"]  # refused to new requests at once
        with pytest.raises(RequestRefused, match="'a' is being unloaded"):
            registry.chosen("a")
        assert not drained.done()
        registry.end("a")  # its last request finishes; b's keeps running
        assert await drained is True
        registry.remove("a")
        with pytest.raises(RequestRefused, match="'a' is no longer served"):
            registry.begin("a")  # a request that chose it before it went: refused, not base
        assert registry.usage() == {"b": 1}
        registry.begin("b")
        assert await registry.drain("b", 0.01) is False  # timed out: b serves again
        assert registry.names() == ["b"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--pp-size", "2", "--adapter", "b/d=/x"], "--adapter: 'b/d' is not an adapter"),
        (["generate", "--pp-size", "2", "--tp-size", "2", "--adapter", "/x", "-p", "hi"],
         "--adapter: adapters run on stages of one rank"),
    ],
)  # fmt: skip
def test_a_bad_adapter_flag_is_one_line_and_exit_2(argv: list[str], says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_adapter_flags_go_on_top_of_a_nodes_toml() -> None:
    from mlxppd.runtime.serve import with_adapter_flags

    cfg = parse_cluster_config(
        TOML + '\n[[adapters]]\nname = "pirate"\npath = "/srv/pirate"\n', "cluster.toml"
    )
    got = with_adapter_flags(cfg, ("/opt/fused", "pirate=/opt/pirate", "robot=/opt/robot"))
    assert got.cluster.adapter == "/opt/fused"
    assert [(a.name, a.path) for a in got.adapters] == [
        ("pirate", "/opt/pirate"), ("robot", "/opt/robot"),
    ]  # fmt: skip
    assert with_adapter_flags(cfg, ()) is cfg
