"""Start-up checks of every rollout server (issue 36, items 3 and 4): expert storage, torch and NCCL versions.

The bugs these catch: a trainer that pushes FP8 experts into a server that built packed-FP4 expert parameters
(SGLang's default when SGLANG_DSV4_FP4_EXPERTS is unset and the checkpoint is the official release), and a
distributed push between two torch/NCCL builds; both used to surface only as a failed or wrong first push.

SGLang reports neither (sglang.preflight's docstring pins where it decides and what /server_info holds), so the
decision is SGLang's own, rebuilt from what it reports (`model_path`, `load_format`) and the variable; the
embedded server reports the same fields, so an embedded server loaded from the official release "reports" FP4
experts exactly as SGLang would.

Run: pytest tests/test_server_preflight.py -q
"""
import os
import subprocess
import sys

import pytest

from nanoflash.checkpoint import load_hf_checkpoint, repack_release_fp8_experts, save_hf_checkpoint
from nanoflash.cli import parse_args
from nanoflash.config import ModelConfig, RolloutConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.rl.collector import preflight
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.sglang.client import SGLangClient
from nanoflash.sglang.preflight import FP4_ENV, ServerMismatch, check_versions, served_experts
from nanoflash.sglang.push import StagePusher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The smoke recipe's model as the official release (FP4 experts), its FP8-expert re-pack, and a directory
    with only config.json (a --load-format dummy server)."""
    d = tmp_path_factory.mktemp("ckpts")
    cfg = preset("tiny", **parse_args(["--recipe", "smoke"]).model)
    save_hf_checkpoint(Transformer(cfg).init_weights(5), str(d / "fp4"), weights="fp8", experts="fp4")
    repack_release_fp8_experts(str(d / "fp4"), str(d / "fp8"))
    os.makedirs(d / "dummy")
    (d / "dummy" / "config.json").write_text((d / "fp8" / "config.json").read_text())
    return {k: str(d / k) for k in ("fp4", "fp8", "dummy")}


def embedded(path: str):
    """An embedded server loaded from the checkpoint at `path`, reporting it as its model_path (as SGLang does)."""
    cfg = ModelConfig.from_hf_config(path)
    model = Transformer(cfg)
    load_hf_checkpoint(model, path)
    return serve(RolloutEngine(model.float(), weights="fp8"), model_path=path)


# ---------------------------------------------------------------------------------------------- the decision
def test_expert_storage_is_decided_as_sglang_decides(ckpts):
    """model_config.py L339-359: the variable when set, else the checkpoint's first routed expert, else FP4."""
    def held(path, env, fmt="auto", **info):
        return served_experts({"model_path": path, "load_format": fmt, **info}, env)[0]
    assert held(ckpts["fp4"], {}) == "fp4"                              # the release, no variable: SGLang probes
    assert held(ckpts["fp8"], {}) == "fp8"                              # the re-pack: probed FP8
    assert held(ckpts["dummy"], {}) == "fp4"                            # nothing to probe: SGLang's default
    assert held("/nowhere/on/this/node", {}) == "fp4"
    for v, want in (("0", "fp8"), ("false", "fp8"), ("N", "fp8"), ("1", "fp4"), ("yes", "fp4"), ("bogus", "fp4")):
        assert held(ckpts["dummy"], {FP4_ENV: v}, "dummy") == want, v  # EnvBool; an invalid value: the default
    assert held(ckpts["fp4"], {FP4_ENV: "0"}, "dummy") == "fp8"       # a dummy load reads no expert
    with pytest.raises(ServerMismatch, match="--from-release"):         # FP4 on disk, FP8 parameters: no load
        held(ckpts["fp4"], {FP4_ENV: "0"})
    with pytest.raises(ServerMismatch, match="F8_E4M3"):
        held(ckpts["fp8"], {FP4_ENV: "1"})
    assert held("nanoflash", {}, "dummy", engine="nanoflash", weights="fp8") == "fp8"   # seeded embedded server
    assert held("nanoflash", {}, "dummy", engine="nanoflash", weights="fp32") == "unquantized"
    assert held("nanoflash", {FP4_ENV: "0"}, "dummy", engine="nanoflash", weights="fp32") == "unquantized"


def test_an_embedded_server_reports_what_sglang_reports(ckpts):
    httpd, url = embedded(ckpts["fp4"])
    try:
        info = SGLangClient(url).server_info(url)
        assert info["model_path"] == ckpts["fp4"] and info["load_format"] == "auto" and info["quantization"] is None
        assert SGLangClient(url).get(url, "/get_model_info")["model_path"] == ckpts["fp4"]
    finally:
        httpd.shutdown()


# ---------------------------------------------------------------------------------------------- the trainer
def test_train_py_refuses_a_server_holding_fp4_experts_in_one_line(ckpts, monkeypatch):
    """The run's server was loaded from the official release (FP4 experts): train.py stops before its first
    push, one line on stderr naming both sides."""
    monkeypatch.delenv(FP4_ENV, raising=False)
    httpd, url = embedded(ckpts["fp4"])
    try:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--train.warmup_steps", "0",
               "--train.progress", "false", "--out", os.path.join(os.path.dirname(ckpts["fp4"]), "run"),
               "--rollout.urls", url]
        env = {k: v for k, v in os.environ.items() if k != FP4_ENV}
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    finally:
        httpd.shutdown()
    assert p.returncode != 0
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert len(err) == 1, p.stderr[-2000:]
    assert "holds routed experts FP4" in err[0] and "I8" in err[0] and "sends them FP8" in err[0], err[0]


def test_the_fp8_repack_is_accepted_and_a_push_verifies(ckpts, monkeypatch, tmp_path):
    monkeypatch.delenv(FP4_ENV, raising=False)
    httpd, url = embedded(ckpts["fp8"])
    try:
        client, rc = SGLangClient(url), RolloutConfig(urls=(url,), weights="fp8")
        preflight(client, rc)                                         # no exit
        model = Transformer(ModelConfig.from_hf_config(ckpts["fp8"])).init_weights(9)
        pusher = StagePusher(ParallelDims(), client, rc, model.cfg, disk_dir=str(tmp_path))
        pusher.push(lambda: model.state_dict().items(), 1)
        assert httpd.rollout.engine.weight_version == pusher.tag(1)   # the step and the launch nonce (issue 39)
        with pytest.raises(SystemExit, match="holds routed experts FP8.*rollout.weights=fp32 sends them UNQUANTIZED"):
            preflight(client, RolloutConfig(urls=(url,), weights="fp32"))
    finally:
        httpd.shutdown()


# ---------------------------------------------------------------------------------------------- versions
def test_a_distributed_push_needs_one_torch_and_nccl(ckpts):
    """The embedded server reports its torch / NCCL; one configured to report others is refused at start-up,
    naming both. A real SGLang reports only its release: the torch that release pins is what is compared."""
    httpd, url = embedded(ckpts["fp8"])
    try:
        client = SGLangClient(url)
        rc = RolloutConfig(urls=(url,), weights="fp8", transport="distributed")
        preflight(client, rc)                                         # same process: same torch
        httpd.rollout.versions = {"torch": "2.11.0+cu130", "nccl": "2.28.9"}
        client.forget(url)
        with pytest.raises(SystemExit, match=r"runs torch 2\.11\.0\+cu130 .*the trainer torch "):
            preflight(client, rc)
        preflight(client, RolloutConfig(urls=(url,), weights="fp8"))   # a tensor push: versions not needed
        assert check_versions(client, {"torch": "2.11.0", "nccl": "2.28.9"}) == []
        with pytest.raises(ServerMismatch, match=r"runs nccl 2\.28\.9 .*the trainer nccl 2\.27\.3"):
            check_versions(client, {"torch": "2.11.0", "nccl": "2.27.3"})
    finally:
        httpd.shutdown()

    class Real:   # what SGLang 0.5.16's /server_info gives: its version, no torch, no NCCL
        urls = ["http://sglang:30000"]

        def __init__(self, version):
            self.version = version

        def server_info(self, url):
            return {"version": self.version, "tp_size": 1}
    assert check_versions(Real("0.5.16"), {"torch": "2.11.0a0+nv25", "nccl": "2.27.3"}) == \
        ["http://sglang:30000: nccl not checked (pinned by SGLang 0.5.16 (torch==2.11.0))"]
    with pytest.raises(ServerMismatch, match=r"runs torch 2\.11\.0 \(pinned by SGLang 0\.5\.16.*trainer torch 2\.13"):
        check_versions(Real("0.5.16"), {"torch": "2.13.0+cpu", "nccl": None})
    assert "not checked" in check_versions(Real("0.6.1"), {"torch": "2.13.0", "nccl": None})[0]


def test_indexer_replay_needs_servers_that_report_their_kept_sets():
    """`rollout.indexer_replay`: a server whose /server_info (SGLang's server args) lacks
    enable_return_indexer_topk=True is refused before the first push, named; one started with it passes."""
    from nanoflash.sglang.preflight import check_indexer_topk

    class Info:
        urls = ["http://sglang:30000"]

        def __init__(self, **info):
            self.info = info

        def server_info(self, url):
            return self.info
    check_indexer_topk(Info(version="0.5.16", enable_return_indexer_topk=True))
    for info in ({"version": "0.5.16", "enable_return_indexer_topk": False}, {"version": "0.5.16"}):
        with pytest.raises(ServerMismatch, match=r"http://sglang:30000 reports enable_return_indexer_topk=(False|None)"
                                                 r": rollout.indexer_replay needs"):
            check_indexer_topk(Info(**info))


def test_indexer_replay_probes_each_servers_record_at_start_up(ckpts):
    """With the model's config the preflight asks each server once for a record (a prompt long enough for the
    top-k to select) and refuses, named, one the trainer could not replay. The embedded server's passes (its
    kept sets are the trainer's rule); SGLang-shaped fakes with the record one row short, an entry the query
    cannot see, too few kept entries at the last query, or no record at all are refused. Bug caught: a record
    format that differs from what the collector checks found at step 1 of a GPU hold instead of at start-up."""
    import base64
    import torch
    from nanoflash.model import c4_layers
    from nanoflash.sglang.client import Generation
    from nanoflash.sglang.preflight import check_indexer_topk
    httpd, url = embedded(ckpts["fp8"])
    mcfg = ModelConfig.from_hf_config(ckpts["fp8"])
    try:
        check_indexer_topk(SGLangClient(url), mcfg)                   # the embedded server's record: accepted
    finally:
        httpd.shutdown()
    K, n_c4 = mcfg.index_topk, len(c4_layers(mcfg))

    class Fake:
        urls = ["http://sglang:30000"]

        def __init__(self, edit):
            self.edit = edit

        def server_info(self, url):
            return {"enable_return_indexer_topk": True}

        def generate(self, prompt, sp, url=None, return_indexer_topk=False):
            P = len(prompt)
            rec = torch.full((P, n_c4, K), -1, dtype=torch.int32)   # each query keeps its last min(K, C) entries
            for t in range(P):
                C = (t + 1) // 4
                rec[t, :, :min(K, C)] = torch.arange(C - 1, C - 1 - min(K, C), -1, dtype=torch.int32)
            meta = self.edit(rec, {})
            return [Generation(list(prompt), [5], [-0.1], "length", None, url, meta)]

    def put(rec, meta):
        return {**meta, "indexer_topk": base64.b64encode(rec.numpy().tobytes()).decode()}
    check_indexer_topk(Fake(put), mcfg)
    bad = {"rows": lambda r, m: put(r[1:], m),
           "beyond its": lambda r, m: put(r.index_put_((torch.tensor([9]), torch.tensor([0]), torch.tensor([0])),
                                                       torch.tensor([5], dtype=torch.int32)), m),
           "keeps": lambda r, m: put(r.index_fill_(0, torch.tensor([r.shape[0] - 1]), -1), m),
           "no indexer_topk": lambda r, m: m}
    for what, edit in bad.items():
        with pytest.raises(ServerMismatch, match=rf"http://sglang:30000: its indexer record cannot be replayed "
                                                 rf"\(.*{what}"):
            check_indexer_topk(Fake(edit), mcfg)
