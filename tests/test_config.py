"""Flags and config validation: every bad input fails at startup with its own one-line error."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil
import pytest
import torch

from sgl_sparsekv import request_control
from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.patches.checks import check_model, check_server_args
from sgl_sparsekv.patches.flags import choose_backend, wrapped_backend

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_defaults_follow_the_paper():
    c = SparseKVConfig.from_method("lychee")
    # one chunk per fine cluster: the paper's most faithful granularity (its Appendix E), not its default of 2
    assert (c.token_budget, c.chunk_min, c.chunk_max, c.fine_cluster_size, c.max_coarse, c.kmeans_iters,
            c.sink_tokens, c.dense_layers) == (1024, 8, 16, 1.0, 64, 10, 16, 2)
    assert SparseKVConfig.from_method("quest").page_size == 16


def test_shipped_configs_load():
    for method in ("lychee", "quest"):
        path = ROOT / "configs" / f"{method}.json"
        c = SparseKVConfig.from_method(method, str(path))
        # the shipped file names every key of its method, with the defaults
        assert c.to_dict() == {"method": method, **json.loads(path.read_text())}
        assert c == SparseKVConfig.from_method(method)


@pytest.mark.parametrize("method,overrides,needle", [
    ("lychee", {"chunk_min": 20}, "chunk_min (20) > chunk_max (16)"),
    ("lychee", {"bogus": 1}, "unknown key 'bogus'"),
    ("lychee", {"token_budget": "1024"}, "key 'token_budget' must be int"),
    ("lychee", {"token_budget": True}, "key 'token_budget' must be int"),
    ("lychee", {"token_budget": 64}, "token_budget (64) must be >= sink_tokens + recent_window"),
    ("lychee", {"token_budget": 0}, "key 'token_budget' must be > 0"),
    ("lychee", {"sink_tokens": -1}, "key 'sink_tokens' must be >= 0"),
    ("lychee", {"recent_window": 8}, "recent_window (8) must be >="),
    ("lychee", {"chunking": "words"}, "key 'chunking' must be 'structure' or 'fixed'"),
    ("lychee", {"fine_bound": "sphere"}, "key 'fine_bound' must be 'ball' or 'box'"),
    ("quest", {"fine_bound": "box"}, "fine_bound"),
    ("lychee", {"gqa_reduce": "sum"}, "key 'gqa_reduce' must be 'max' or 'mean'"),
    ("lychee", {"coarse_expand": 0.5}, "key 'coarse_expand' must be >= 1"),
    ("lychee", {"coarse_expand_min": -1}, "key 'coarse_expand_min' must be >= 0"),
    ("lychee", {"coarse_expand_min": 3e4}, "key 'coarse_expand_min' must be int, got float"),
    ("quest", {"coarse_expand_min": 0}, "key 'coarse_expand_min' applies to --sparse-kv lychee, not quest"),
    ("lychee", {"radius_weight": 1.5}, "key 'radius_weight' must be in [0, 1]"),
    ("quest", {"radius_weight": 0.0}, "key 'radius_weight' applies to --sparse-kv lychee, not quest"),
    ("lychee", {"rerank_factor": 0}, "key 'rerank_factor' must be in [1, 8], got 0"),
    ("lychee", {"rerank_factor": 2.0}, "key 'rerank_factor' must be int, got float 2.0"),
    ("quest", {"rerank_factor": 2}, "key 'rerank_factor' applies to --sparse-kv lychee, not quest"),
    ("lychee", {"select_every": 0}, "key 'select_every' must be > 0, got 0"),
    ("quest", {"recall_audit_every": -1}, "key 'recall_audit_every' must be >= 0, got -1"),
    ("lychee", {"select_every": 4, "rerank_factor": 2}, "select_every > 1 needs head_roles 'all-retrieval'"),
    ("lychee", {"select_every": 4, "head_roles": "staggered-0.25"}, "select_every > 1 needs head_roles"),
    ("quest", {"select_every": 2}, "key 'select_every' applies to --sparse-kv lychee, not quest"),
    ("lychee", {"select_ahead": 1}, "key 'select_ahead' must be bool, got int 1"),
    ("lychee", {"select_ahead": True, "rerank_factor": 2}, "select_ahead needs head_roles 'all-retrieval' and rerank"),
    ("lychee", {"select_ahead": True, "head_roles": "staggered-0.25"}, "select_ahead needs head_roles"),
    ("quest", {"select_ahead": True}, "key 'select_ahead' applies to --sparse-kv lychee, not quest"),
    ("lychee", {"host_tier": 1}, "key 'host_tier' must be bool, got int 1"),
    ("lychee", {"host_tier": True, "dense_layers": 0}, "host_tier needs dense_layers >= 1"),
    ("quest", {"host_tier": True, "host_window": 64}, "host_window (64) must be >= recent_window + one chunk/page = 80"),
    ("lychee", {"host_tier": True, "rerank_factor": 2}, "host_tier does not run with rerank_factor > 1 yet"),
    ("lychee", {"host_tier": True, "head_roles": "staggered-0.5"}, "host_tier does not run with head_roles yet"),
    ("lychee", {"host_tier": True, "token_budget": 256, "select_every": 250},
     "host_tier needs select_every (250) <= token_budget - recent_window = 192"),
    ("lychee", {"host_memory_gb": 64}, "host_memory_gb sizes the host tier's pool; it needs host_tier true"),
    ("quest", {"host_tier": True, "host_memory_gb": -1.0}, "key 'host_memory_gb' must be >= 0, got -1.0"),
    ("lychee", {"host_tier": True, "sink_tokens": 32}, "host_tier needs sink_tokens (32) <= the largest chunk/page (16)"),
    ("lychee", {"page_size": 8}, "key 'page_size' applies to --sparse-kv quest, not lychee"),
    ("quest", {"chunk_min": 4}, "key 'chunk_min' applies to --sparse-kv lychee, not quest"),
    ("quest", {"method": "lychee"}, "key 'method' is 'lychee' but --sparse-kv is 'quest'"),
    ("off", {"token_budget": 512}, "--sparse-kv-config was given but --sparse-kv is off"),
    ("dense", None, "unknown method 'dense'"),
])
def test_bad_config_names_the_key(method, overrides, needle):
    with pytest.raises(ConfigError) as e:
        SparseKVConfig.from_method(method, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_config_sources(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"token_budget": 512}')
    assert SparseKVConfig.from_method("lychee", str(p)).token_budget == 512
    assert SparseKVConfig.from_method("lychee", '{"token_budget": 256}').token_budget == 256
    with pytest.raises(ConfigError, match="neither a JSON object nor an existing file"):
        SparseKVConfig.from_method("lychee", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="is not valid JSON"):
        SparseKVConfig.from_method("lychee", '{"token_budget": }')
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        SparseKVConfig.from_method("lychee", str(p))


def _sa(**kw):
    """Server args as SGLang's ServerArgs defaults them (without its __post_init__, which wants a real model)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    base = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(ServerArgs)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    base.update(model_path="/nonexistent", attention_backend="torch_native", device="cpu")
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw,needle", [
    (dict(speculative_algorithm="EAGLE"), "--speculative-algorithm"),
    (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
    (dict(pp_size=2), "--pp-size > 1"),
    (dict(enable_dp_attention=True), "--enable-dp-attention"),
    (dict(attention_backend="fa3"), "--attention-backend fa3 is not supported"),
    (dict(decode_attention_backend="trtllm_mha"), "--decode-attention-backend trtllm_mha"),
    (dict(is_embedding=True), "--is-embedding"),
    (dict(kv_cache_dtype="fp4_e2m1"), "--kv-cache-dtype fp4_e2m1 is not supported; use one of auto,"),
])
def test_unsupported_server_flags(kw, needle):
    with pytest.raises(ConfigError, match=None) as e:
        check_server_args(_sa(**kw), SparseKVConfig.from_method("lychee"))
    assert needle in str(e.value)


@pytest.mark.parametrize("method", ["lychee", "quest"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_accepted(method, dtype):
    check_server_args(_sa(kv_cache_dtype=dtype), SparseKVConfig.from_method(method))


def test_disable_radix_cache_is_fine():
    check_server_args(_sa(disable_radix_cache=True), SparseKVConfig.from_method("lychee"))


def test_tensor_and_data_parallel_are_accepted():
    check_server_args(_sa(tp_size=2, dp_size=2), SparseKVConfig.from_method("lychee"))
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=32, num_key_value_heads=8)
    check_model(llama, SparseKVConfig.from_method("lychee"), tp_size=16)   # each KV head on two ranks
    with pytest.raises(ConfigError, match="8 KV heads do not split evenly over --tp-size 3"):
        check_model(llama, SparseKVConfig.from_method("lychee"), tp_size=3)


@pytest.mark.parametrize("hf,needle", [
    (dict(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512), "MLA"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), "sliding-window"),
    (dict(architectures=["Gemma3ForCausalLM"], layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
    (dict(architectures=["JambaForCausalLM"]), "hybrid Mamba"),
    (dict(architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M-M*"), "hybrid Mamba"),
    (dict(architectures=["T5ForConditionalGeneration"], is_encoder_decoder=True), "encoder-decoder"),
    (dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2), "dense_layers (2) must be <"),
])
def test_unsupported_models(hf, needle):
    with pytest.raises(ConfigError) as e:
        check_model(SimpleNamespace(**hf), SparseKVConfig.from_method("lychee"))
    assert needle in str(e.value)


def test_host_tier_checks():
    """The tier needs a bound on the requests it decodes at once (their hot buffers are allocated at startup), and
    refuses a model whose own config is hybrid sliding-window; the hybrid layers the tier declares itself
    (patches/host_tier.py) pass the model check."""
    tier = SparseKVConfig.from_method("lychee", {"host_tier": True, "host_window": 512})
    for running in (None, 65):   # SGLang's default on the CPU engine is 4,096
        with pytest.raises(ConfigError, match="host_tier needs --max-running-requests of at most 64"):
            check_server_args(_sa(max_running_requests=running), tier)
    check_server_args(_sa(max_running_requests=64), tier)
    ours = dict(architectures=["LlamaForCausalLM"], num_hidden_layers=5, is_hybrid_swa=True,
                hybrid_layer_pattern=[0, 0, 1, 1, 1], sliding_window_size=1024)
    check_model(SimpleNamespace(**ours), tier)
    for cfg, hf in ((SparseKVConfig.from_method("lychee"), ours),   # the same keys without the tier: the model's own
                    (tier, dict(ours, hybrid_layer_pattern=[0, 1, 0, 1, 1]))):
        with pytest.raises(ConfigError, match="hybrid sliding-window layers"):
            check_model(SimpleNamespace(**hf), cfg)


def test_supported_models_pass():
    cfg = SparseKVConfig.from_method("lychee")
    check_model(SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=32), cfg)
    check_model(SimpleNamespace(architectures=["Qwen2ForCausalLM"], sliding_window=32768, use_sliding_window=False,
                                num_hidden_layers=28), cfg)


# one fresh interpreter parses several command lines in turn, as launch_server would each: SGLang's own parser with
# the plugins loaded; per line, what it parsed, or the last line a failed launch would print (our SystemExit's
# message, else argparse's last stderr line), or the exception that ended it otherwise
PARSE_MANY = """
import contextlib, io, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.argv[1]):
    err, said = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(said):
            sa = prepare_server_args(argv)
        out.append({"parsed": f"PARSED {sa.sparse_kv} {sa.sparse_kv_config}", "chunk": sa.chunked_prefill_size})
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        out.append({"exit": e.code if isinstance(e.code, str) or not lines else lines[-1], "stderr": err.getvalue(),
                    "stdout": said.getvalue()})
    except BaseException as e:
        out.append({"raised": repr(e)})
print(json.dumps(out))
"""


def test_cli_flags_parse_and_fail_fast(smollm2_dir):
    base = ["--model-path", smollm2_dir, "--device", "cpu", "--grammar-backend", "none"]
    failing = [
        (["--sparse-kv", "lychee", "--sparse-kv-config", '{"chunk_max": 4}'], "chunk_min (8) > chunk_max (4)"),
        (["--sparse-kv", "quest", "--enable-mixed-chunk"], "--enable-mixed-chunk is not supported"),
        (["--sparse-kv", "sparse"], "invalid choice: 'sparse'"),
        (["--sparse-kv", "lychee", "--sparse-kv-config", '{"head_roles": "qwen2.5-coder-0.5b-calibrated-0.25"}'],
         "(made for qwen2.5-coder-0.5b: 24 layers, 2 KV heads, 2 dense) does not fit this model (30 layers"),
    ]
    tier = ["--sparse-kv", "lychee", "--sparse-kv-config", '{"host_tier": true}', "--max-running-requests", "8"]
    runs = [["--sparse-kv", "lychee", "--sparse-kv-config", '{"token_budget": 256}', "--kv-cache-dtype", "fp8_e4m3"],
            [], ["--help"], tier, tier + ["--chunked-prefill-size", "512"]] + [e for e, _ in failing]
    p = subprocess.run([sys.executable, "-c", PARSE_MANY, json.dumps([base + r for r in runs])], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    ok, off, usage, tiered, told, *bads = json.loads(p.stdout.strip().splitlines()[-1])
    assert "PARSED lychee {" in ok["parsed"] and "'token_budget': 256" in ok["parsed"], ok
    # the host tier prefills in chunks of 2,048 unless told (each running request keeps its last chunk on the device)
    assert "'host_tier': True" in tiered["parsed"] and tiered["chunk"] == 2048 and told["chunk"] == 512
    assert ok["chunk"] == off["chunk"]   # without the tier, SGLang's own default
    assert off["parsed"].startswith("PARSED off {'method': 'off'"), off
    # launch_server --help lists the two flags
    assert "--sparse-kv {off,lychee,quest}" in usage["stdout"] and "--sparse-kv-config FILE_OR_JSON" in usage["stdout"]
    for bad, (_, needle) in zip(bads, failing):
        assert needle in bad.get("exit", ""), bad   # one line, the last a launch prints, and no traceback
        assert "Traceback" not in bad["stderr"]


def test_engine_kwargs(smollm2_dir):
    """The Python path: ServerArgs (what sglang.Engine builds from its kwargs) takes the same two keys."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=smollm2_dir, device="cpu", sparse_kv="quest", sparse_kv_config={"token_budget": 512})
    assert sa.sparse_kv == "quest" and sa.sparse_kv_config["token_budget"] == 512
    assert sa.attention_backend == "torch_native"
    with pytest.raises(ConfigError, match="unknown key 'budget'"):
        ServerArgs(model_path=smollm2_dir, device="cpu", sparse_kv="quest", sparse_kv_config={"budget": 512})
    assert ServerArgs(model_path=smollm2_dir, device="cpu").sparse_kv == "off"
    # the host tier declares the sparse layers windowed through the model overrides every process reads, beside
    # the user's own keys; a key of its own given by the user is refused
    sa = ServerArgs(model_path=smollm2_dir, device="cpu", sparse_kv="lychee", json_model_override_args='{"x": 1}',
                    sparse_kv_config={"host_tier": True, "host_window": 512}, max_running_requests=8)
    assert json.loads(sa.json_model_override_args) == {
        "x": 1, "is_hybrid_swa": True, "sliding_window_size": 512, "hybrid_layer_pattern": [0, 0] + [1] * 28}
    with pytest.raises(ConfigError, match="host_tier sets --json-model-override-args key.s. sliding_window_size"):
        ServerArgs(model_path=smollm2_dir, device="cpu", sparse_kv="lychee", sparse_kv_config={"host_tier": True},
                   json_model_override_args='{"sliding_window_size": 4096}', max_running_requests=8)


@pytest.mark.parametrize("device,flashinfer,expected", [
    ("cpu", False, "torch_native"),          # SGLang's x86 default with AMX is intel_amx
    ("cuda", True, "flashinfer"),            # SGLang's Hopper default is fa3
    ("cuda:1", False, "triton"),
    (None, True, "flashinfer"),              # no --device: what SGLang resolves it to (here a GPU)
    ("xpu", True, None),                     # left to SGLang, and to the startup check that names it
])
def test_a_backend_we_wrap_where_none_is_given(monkeypatch, device, flashinfer, expected):
    import sglang.srt.utils as su

    monkeypatch.setattr(su, "is_flashinfer_available", lambda: flashinfer)
    monkeypatch.setattr(su, "get_device", lambda: "cuda")
    assert wrapped_backend(device) == expected
    args = dict(device=device)
    choose_backend(args.get, args.__setitem__)
    assert args.get("attention_backend") == expected
    given = dict(device=device, decode_attention_backend="triton")
    choose_backend(given.get, given.__setitem__)
    assert "attention_backend" not in given


@pytest.mark.parametrize("method,config,given,expected", [
    ("lychee", {"host_tier": True}, None, 2048),   # each running request keeps its last chunk on the device
    ("lychee", {"host_tier": True}, 4096, 4096),
    ("quest", {"host_tier": True}, None, 2048),
    ("lychee", None, None, None),                  # SGLang's own default
    ("off", None, None, None),
])
def test_the_host_tier_prefills_in_short_chunks_unless_told(method, config, given, expected):
    from sgl_sparsekv.patches.flags import prepare

    args = {"device": "cpu", "chunked_prefill_size": given}
    prepare(method, config, args.get, args.__setitem__)
    assert args["chunked_prefill_size"] == expected
    assert args.get("disable_prefill_cuda_graph") is (None if method == "off" else True)
    with pytest.raises(ConfigError, match="unknown key"):   # a bad config stops the parse before SGLang's own
        prepare("lychee", {"no_such_key": 1}, args.get, args.__setitem__)


def test_no_device_and_no_backend_resolve_as_sglang_would(monkeypatch):
    import sglang.srt.utils as su

    def no_accelerator():
        raise RuntimeError("No accelerator")

    monkeypatch.setattr(su, "get_device", no_accelerator)
    assert wrapped_backend(None) is None


@pytest.mark.gpu
def test_the_gpu_resolves_to_flashinfer():
    """On the device itself: no --device, no backend -> SGLang's device resolution says cuda, FlashInfer is there."""
    assert wrapped_backend(None) == "flashinfer"


def _launch_renamed(*args):
    """SGLang's real CLI parsing (plugins loaded as in launch_server, no server started), on an SGLang whose
    ModelRunner._get_attention_backend was renamed (what an upgrade could do)."""
    code = ("import sys; import sglang.srt.model_executor.model_runner as mr; "
            "mr.ModelRunner._renamed = mr.ModelRunner._get_attention_backend; "
            "del mr.ModelRunner._get_attention_backend; "
            "from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.server_args import prepare_server_args; "
            "sa = prepare_server_args(sys.argv[1:]); print('PARSED', sa.sparse_kv)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_missing_sglang_internal_refuses_to_start(smollm2_dir):
    """A hook that could not apply makes --sparse-kv refuse to start with one line naming it (never serve dense);
    --sparse-kv off is not affected."""
    base = ["--model-path", smollm2_dir, "--device", "cpu", "--grammar-backend", "none"]
    with ThreadPoolExecutor(2) as pool:   # two fresh interpreters importing SGLang, side by side
        bad, off = pool.map(lambda extra: _launch_renamed(*base, *extra), [["--sparse-kv", "lychee"], []])
    assert bad.returncode != 0 and "PARSED" not in bad.stdout
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sparse-kv: this SGLang lacks") and "ModelRunner._get_attention_backend" in last
    assert off.returncode == 0 and "PARSED off" in off.stdout


def test_scheduler_refuses_a_dense_backend():
    """The scheduler-side check: sparse-kv on, but the model runner's backend is not the sparse one."""
    from sgl_sparsekv.patches.plugin import check_scheduler

    cfg = SparseKVConfig.from_method("lychee").to_dict()
    runner = SimpleNamespace(attn_backend=object())
    sched = SimpleNamespace(server_args=SimpleNamespace(sparse_kv_config=cfg, enable_metrics=False),
                            tp_worker=SimpleNamespace(model_runner=runner), is_fully_idle=lambda: True,
                            ps=SimpleNamespace(tp_rank=0, dp_rank=None), tp_cpu_group=None)
    with pytest.raises(ConfigError, match="attention backend is object, not the sparse one"):
        check_scheduler(None, sched)
    off = SimpleNamespace(server_args=SimpleNamespace(sparse_kv_config={"method": "off"}))
    assert check_scheduler(None, off) is None


def test_surface_lists_every_hook():
    """Every hook the plugin registers is in patches/surface.py, the list checked at startup."""
    from sgl_sparsekv.patches import plugin, surface

    assert set(plugin._HOOKS) == set(surface.HOOK_TARGETS)
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        HookRegistry._hooks.clear()
        plugin.register()
        assert set(HookRegistry._hooks) == set(surface.HOOK_TARGETS.values())
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


@pytest.mark.parametrize("method", ["lychee", "quest"])
def test_index_cache_is_set_aside_before_the_kv_pool(monkeypatch, method):
    """The cached indexes count in SGLang's memory plan: charge_index_memory adds the pools per KV slot and marks
    the cache's bytes, which reserve_index_cache takes off the memory the KV pool is sized from."""
    import sglang.srt.layers.dp_attention as dp
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    from sgl_sparsekv.index_cache import CACHE_BYTES
    from sgl_sparsekv.patches.plugin import charge_index_memory, reserve_index_cache

    monkeypatch.setattr(dp, "get_attention_tp_size", lambda: 1)
    mc = SimpleNamespace(get_num_kv_heads=lambda tp: 8, head_dim=128)
    runner = SimpleNamespace(server_args=SimpleNamespace(sparse_kv_config=SparseKVConfig.from_method(method).to_dict()),
                             is_draft_worker=False, model_config=mc, device="cuda")
    conf = object.__new__(DefaultPoolConfigurator)
    kv = 32 * 8 * 128 * 2 * 2
    conf._cell_size = charge_index_memory(kv, conf, runner, 32)
    assert conf._cell_size > kv
    original = getattr(DefaultPoolConfigurator.calculate_pool_sizes, "__wrapped__",
                       DefaultPoolConfigurator.calculate_pool_sizes)
    available = 40 * CACHE_BYTES
    tokens = reserve_index_cache(original, conf, available, 1).max_total_num_tokens
    assert tokens == (available - CACHE_BYTES) // conf._cell_size


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_host_tier_memory_is_charged_where_it_lives(monkeypatch, device):
    """With the host tier, SGLang's hybrid configurator is charged per full KV slot for the index pools, the
    prefill's stage (one sparse layer) and, on the CPU engine, the host pool (host and device memory are one); on a
    GPU the hot buffers, one set per request SGLang can run, are set aside before the pools are sized, as many bytes
    as the decoders allocate (the H100 run's hot_buffer_bytes for the Llama-3.1-8B shape: 19,126,026,240)."""
    import sglang.srt.layers.dp_attention as dp
    from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator

    from sgl_sparsekv.index_cache import CACHE_BYTES
    from sgl_sparsekv.manager import bytes_per_token
    from sgl_sparsekv.patches.plugin import charge_index_memory_swa

    monkeypatch.setattr(dp, "get_attention_tp_size", lambda: 1)
    cfg = SparseKVConfig.from_method("lychee", {"host_tier": True})
    mc = SimpleNamespace(get_num_kv_heads=lambda tp: 8, head_dim=128, num_hidden_layers=32)
    runner = SimpleNamespace(server_args=SimpleNamespace(sparse_kv_config=cfg.to_dict(), max_running_requests=32),
                             is_draft_worker=False, model_config=mc, device=device)
    conf = object.__new__(HybridSWAPoolConfigurator)
    token = 8 * (128 + 128) * 2   # one token's K and V in one layer
    conf._swa_per_token, conf._swa_layers_num, conf._swa_full_tokens_ratio = token, 30, 0.5   # the operator's ratio
    conf._cell_size = 2 * token + 0.5 * 30 * token
    cell = conf._cell_size
    charge_index_memory_swa(None, conf, runner)
    index = bytes_per_token(cfg, 32, 8, 128)
    if device == "cuda":
        assert conf.sparse_kv_reserved_bytes - CACHE_BYTES == 19_126_026_240
        assert conf._cell_size == cell + index + token
    else:
        assert conf.sparse_kv_reserved_bytes == CACHE_BYTES
        assert conf._cell_size == cell + index + token + 30 * token


@pytest.mark.parametrize("gib, capped", [(1, True), (1000, False)])
def test_host_tier_kv_slots_are_capped_by_the_host_pool(monkeypatch, gib, capped):
    """The memory plan gives the hybrid pools no more full KV slots than host_memory_gb holds the sparse layers' KV
    of (1 GiB: 8,738 rows of 30 layers x 4 KiB, one of them SGLang's padding slot), and leaves a plan the host holds as SGLang made it."""
    import sglang.srt.layers.dp_attention as dp
    from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator

    from sgl_sparsekv.patches.plugin import charge_index_memory_swa, reserve_index_cache

    monkeypatch.setattr(dp, "get_attention_tp_size", lambda: 1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2000 * 2**30))   # a big host
    cfg = SparseKVConfig.from_method("lychee", {"host_tier": True, "host_memory_gb": float(gib)})
    mc = SimpleNamespace(get_num_kv_heads=lambda tp: 8, head_dim=128, num_hidden_layers=32)
    runner = SimpleNamespace(server_args=SimpleNamespace(sparse_kv_config=cfg.to_dict(), max_running_requests=8),
                             is_draft_worker=False, model_config=mc, device="cuda")
    conf = object.__new__(HybridSWAPoolConfigurator)
    token = 8 * (128 + 128) * 2
    conf._swa_per_token, conf._swa_layers_num, conf._full_layers_num = token, 30, 2
    conf._swa_full_tokens_ratio = 0.25
    conf._cell_size = 2 * token + 0.25 * 30 * token
    charge_index_memory_swa(None, conf, runner)
    original = getattr(HybridSWAPoolConfigurator.calculate_pool_sizes, "__wrapped__",
                       HybridSWAPoolConfigurator.calculate_pool_sizes)
    available = conf.sparse_kv_reserved_bytes + 100_000 * int(conf._cell_size)   # 100,000 slots on the device
    sizes = reserve_index_cache(original, conf, available, 1)
    slots = 2**30 * gib // (30 * token) - 1   # a padding slot beside them (page size 1)
    assert slots == (8737 if gib == 1 else 8_738_132)
    assert sizes.full_max_total_num_tokens == (slots if capped else 100_000)
    assert sizes.swa_max_total_num_tokens == int(sizes.full_max_total_num_tokens * 0.25)


@pytest.mark.parametrize("ratio", [0.8, 0.5])
def test_host_tier_window_pool_holds_its_requests_windows(monkeypatch, ratio):
    """At SGLang's default --swa-full-tokens-ratio (0.8) the tier's window pool is sized for the requests it runs:
    8 requests, each with its window (1,024), its last prefill chunk (2,048), the tokens decoded since SGLang last
    freed its slots (128) and 2 pages, and 2 chunks in flight: 8 x 3,202 + 2 x 2,048 = 29,712 slots, set aside
    before the full pool, which takes the rest at its own bytes per slot. A ratio the operator gives is SGLang's to
    apply; a plan whose set-aside bytes leave nothing for the KV pool is refused with one line."""
    import sglang.srt.layers.dp_attention as dp
    from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator

    from sgl_sparsekv.patches.plugin import charge_index_memory_swa, reserve_index_cache

    monkeypatch.setattr(dp, "get_attention_tp_size", lambda: 1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2000 * 2**30))
    cfg = SparseKVConfig.from_method("lychee", {"host_tier": True})
    mc = SimpleNamespace(get_num_kv_heads=lambda tp: 8, head_dim=128, num_hidden_layers=32, context_len=131072)
    sa = SimpleNamespace(sparse_kv_config=cfg.to_dict(), max_running_requests=8, chunked_prefill_size=2048,
                         page_size=1)
    runner = SimpleNamespace(server_args=sa, is_draft_worker=False, model_config=mc, device="cuda")
    conf = object.__new__(HybridSWAPoolConfigurator)
    token = 8 * (128 + 128) * 2
    conf._swa_per_token, conf._swa_layers_num, conf._full_layers_num = token, 30, 2
    conf._swa_full_tokens_ratio, conf._draft_full_layers_num = ratio, 0
    conf._cell_size = 2 * token + ratio * 30 * token
    charge_index_memory_swa(None, conf, runner)
    original = getattr(HybridSWAPoolConfigurator.calculate_pool_sizes, "__wrapped__",
                       HybridSWAPoolConfigurator.calculate_pool_sizes)
    available = conf.sparse_kv_reserved_bytes + 100_000 * int(conf._cell_size)
    sizes = reserve_index_cache(original, conf, available, 1)
    assert sizes.full_max_total_num_tokens == 100_000
    assert sizes.swa_max_total_num_tokens == (29_712 if ratio == 0.8 else 50_000)
    with pytest.raises(ConfigError, match="leave nothing of the .* for the KV pool; lower --max-running-requests"):
        reserve_index_cache(original, conf, conf.sparse_kv_reserved_bytes, 1)


@pytest.mark.parametrize("chunk, page, want", [(2048, 1, (2048, 130)), (-1, 1, (32768, 130)),
                                              (None, 16, (32768, 160))])
def test_window_terms_read_the_servers_prefill_chunk_and_slack(chunk, page, want):
    """The window rule's terms, one helper for the memory plan and the startup log: without chunked prefill (-1, or
    none resolved) a prompt is one chunk as long as the context; the slack is SGLang's 128 decoded tokens between
    window evictions and two pages."""
    from sgl_sparsekv.patches.host_tier import window_terms

    assert window_terms(SimpleNamespace(chunked_prefill_size=chunk, page_size=page), 32768) == want


def test_expansion_is_coarse_expand_raised_to_the_floor():
    """Budget 1024 (944 retrieved) keeps coarse_expand's 32 x 944 tokens; budget 256 (176) expands the floor's
    30000 tokens, not 32 x 176; floor 0 is coarse_expand alone."""
    c = SparseKVConfig.from_method("lychee")
    assert c.expansion(944) == 32.0 and c.expansion(176) * 176 == pytest.approx(30000)
    assert SparseKVConfig.from_method("lychee", {"coarse_expand_min": 0}).expansion(176) == 32.0
    # one budget per head (attention-recall's adaptive budgets): the same rule per element
    per_head = c.expansion(torch.tensor([[944], [176], [0]]))
    assert per_head[:, 0].tolist() == pytest.approx([32.0, 30000 / 176, 30000.0])


def test_benchmark_variants_named_expand_n_expand_n_times_the_budget():
    """A bench variant named for its coarse expansion (lychee-expand-8, ...) keeps that factor at every budget: the
    floor under the expansion would otherwise raise it to about 32 at budget 1024 and make it the default."""
    from bench.fidelity import METHODS
    from bench.gpu_serving import VARIANTS as SERVING

    named = {**{f"fidelity {k}": extra for k, (_, extra) in METHODS.items()},
             **{f"gpu_serving {k}": v for k, v in SERVING.items()}}
    checked = 0
    for name, extra in named.items():
        factor = name.rpartition("expand-")[2]
        if factor.replace(".", "").isdigit():
            for budget in (256, 1024, 2048):
                cfg = SparseKVConfig.from_method("lychee", {**extra, "token_budget": budget})
                retrieved = (budget - cfg.sink_tokens - cfg.recent_window) * cfg.rerank_factor
                assert cfg.expansion(retrieved) == float(factor), (name, budget)
            checked += 1
    assert checked >= 5   # fidelity's 8, 16, 32 and rerank-2-expand-8; gpu_serving's 8


@pytest.mark.parametrize("value,want", [(None, None), ("off", 0), ({"token_budget": 512}, 512),
                                        ({"token_budget": 1024}, None), ({"token_budget": 81}, 81)])
def test_request_control_reads_a_requests_budget(value, want):
    assert request_control.parse(value, SparseKVConfig.from_method("lychee")) == want


@pytest.mark.parametrize("method,value,needle", [
    ("lychee", "dense", "expected \"off\" or {\"token_budget\": N}, got 'dense'"),
    ("lychee", {"token_budget": 2048}, "token_budget 2048 is outside (80, 1024]"),
    ("lychee", {"token_budget": 80}, "token_budget 80 is outside (80, 1024]"),
    ("lychee", {"token_budget": 512.0}, "token_budget must be an integer, got 512.0"),
    ("lychee", {"token_budget": True}, "token_budget must be an integer, got True"),
    ("quest", {"budget": 512}, "unknown key 'budget'"),
    ("off", {"token_budget": 512}, "this server decodes densely (--sparse-kv off)"),
])
def test_request_control_refuses_what_the_server_cannot_honour(method, value, needle):
    with pytest.raises(ValueError) as e:
        request_control.parse(value, SparseKVConfig.from_method(method))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_dense_server_accepts_off():
    assert request_control.parse("off", SparseKVConfig.from_method("off")) == request_control.OFF
