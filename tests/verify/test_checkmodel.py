"""Checks with real models: where the model comes from, and answers that are robust texts. A model folder
whose files are links out of it (a snapshot in Hugging Face's cache) is refused: a container mounting it
reads none of them, shown here on a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkbuild.errors import ConfigError, EngineError, VerifyError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.util.net import free_port
from sparkbuild.verify import checkmodel
from sparkbuild.verify.verify import Answer
from tests.support.matrix import MatrixWriter, local_target

BODY = """\
checks:
  real:
    model: {model}
    prompts: [{prompt}]
bases:
  deb:
    debootstrap: {{suite: bookworm, mirror: "http://deb.debian.org/debian"}}
"""


def body(model: str, prompt: str) -> str:
    return BODY.format(model=model, prompt=prompt) + "targets:\n" + local_target(check="real")


PROMPT = '{name: capital, api: completions, prompt: "The capital of France is", contains: Paris, max_tokens: 8}'


def check_of(write_matrix: MatrixWriter, model: str, prompt: str = PROMPT) -> matrix.Check:
    return matrix.load(write_matrix(body(model, prompt), with_checks=False)).checks["real"]


def test_a_check_names_a_hub_model_at_a_revision(write_matrix: MatrixWriter) -> None:
    check = check_of(write_matrix, "{hub: openai/gpt-oss-120b, revision: 0a1b2c3d}")
    assert check.hub == matrix.HubModel(id="openai/gpt-oss-120b", revision="0a1b2c3d") and check.model == "openai/gpt-oss-120b"
    assert check.prompts[0].match == "contains" and check.prompts[0].expect == "Paris"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{hub: openai/gpt-oss-120b}", r"missing required key 'revision'|revision"),
        ("{hub: gpt-oss, revision: main}", r"'gpt-oss' is not a Hugging Face model id"),
        ("{hub: a/b, revision: main, path: x}", r"give a recipe name"),
        ("llama", r"llama"),
    ],
)
def test_a_wrong_model_is_a_matrix_error(write_matrix: MatrixWriter, model: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_of(write_matrix, model)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ('{name: a, api: completions, prompt: "x", expect: " y", contains: y, max_tokens: 4}', r"give one of 'expect'"),
        ('{name: a, api: completions, prompt: "x", max_tokens: 4}', r"give one of 'expect'"),
        ('{name: a, api: completions, prompt: "x", regex: "(", max_tokens: 4}', r"regex.*not a regular expression"),
    ],
)
def test_a_prompt_expects_exactly_one_kind_of_answer(write_matrix: MatrixWriter, prompt: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_of(write_matrix, "alphabet", prompt)


def test_answers_are_judged_as_the_prompt_says() -> None:
    def answer(match: str, expected: str, received: str) -> Answer:
        return Answer(name="a", api="completions", prompt="p", expected=expected, received=received, match=match)  # type: ignore[arg-type]

    assert answer("contains", "Paris", " Paris, the city of light").ok
    assert not answer("contains", "Paris", " Lyon").ok
    assert answer("regex", r"\b579\b", " The sum is 579.").ok
    assert not answer("regex", r"\b579\b", " 5790").ok
    assert answer("exact", " g h i j", " g h i j ").ok and not answer("exact", " g h", " g h i j").ok


def test_a_folder_model_is_served_as_it_is(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    check = check_of(write_matrix, "{path: my-model}")  # relative to the matrix
    with pytest.raises(ConfigError, match=r"has no config.json: give a model folder"):
        checkmodel.provide(tmp_path / "cache", check)
    (folder / "config.json").write_text("{}")
    assert checkmodel.provide(tmp_path / "cache", check) == folder


def test_a_hub_model_that_cannot_be_fetched_says_so(
    write_matrix: MatrixWriter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Hub at a loopback port where nothing listens: what a runner without it sees, with no traffic leaving."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_TOKEN", "hf_sparkbuild_test_token_never_shown")
    check = check_of(write_matrix, "{hub: openai/gpt-oss-120b, revision: main}")
    with pytest.raises(VerifyError) as failed:
        checkmodel.provide(tmp_path / "cache", check)
    message = str(failed.value)
    assert message.startswith("cannot reach the Hugging Face Hub for openai/gpt-oss-120b@main")
    assert "put the model in a folder and name it in the check as model: {path: DIR}" in message
    shown = capsys.readouterr()
    assert "with HF_TOKEN" in shown.err
    assert "hf_sparkbuild_test_token_never_shown" not in message + shown.out + shown.err


def hub_cache_snapshot(root: Path) -> Path:
    """A snapshot as huggingface_hub's cache lays it out: each file a relative link to a blob two folders up."""
    repo = root / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0a1b2c3d"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "9f86d08").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (snapshot / "config.json").symlink_to(Path("..", "..", "blobs", "9f86d08"))
    return snapshot


def test_a_model_folder_of_links_out_of_it_is_refused_naming_the_file(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    snapshot = hub_cache_snapshot(tmp_path)
    check = check_of(write_matrix, f"{{path: {snapshot}}}")
    with pytest.raises(ConfigError) as refused:
        checkmodel.provide(tmp_path / "cache", check)
    said = str(refused.value)
    assert f"{snapshot / 'config.json'} is a link to {tmp_path / 'models--org--model' / 'blobs' / '9f86d08'}" in said
    assert "cannot follow it" in said and "--local-dir DIR" in said


@pytest.mark.docker
def test_a_container_mounting_a_hub_cache_snapshot_reads_none_of_its_files(engine: Engine, base: str, tmp_path: Path) -> None:
    """Why: the server's container mounts the model folder alone, and the links lead out of it (the hub
    checks served from huggingface_hub's cache layout before, 2026-12-07). A folder of real files, as a
    ``local_dir`` download makes, reads."""
    snapshot = hub_cache_snapshot(tmp_path)
    read = ["cat", "/model/config.json"]
    with pytest.raises(EngineError, match=r"No such file or directory"):
        engine.output(base, read, mounts={snapshot: ("/model", "ro")})
    real = tmp_path / "local-dir"
    real.mkdir()
    (real / "config.json").write_text((snapshot / "config.json").read_text())
    assert "LlamaForCausalLM" in engine.output(base, read, mounts={real: ("/model", "ro")})
