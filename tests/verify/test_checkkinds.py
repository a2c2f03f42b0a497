"""The check kinds' judging and making (sparkbuild/verify/checkkinds.py), and their matrix keys.

Both sides of each pass rule are held here on answers written to match or miss it: the tiny check models
cannot do arithmetic or find a pass key, so the local image shows only the failing side of those two
(tests/verify/test_kernel_gate.py), and a runner serving the real models the passing one
(docs/check-kinds.md). The burn-in and the long generation pass there on the alphabet model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.lanes import pipeline
from sparkbuild.plan import matrix
from sparkbuild.verify import checkkinds, verify
from sparkbuild.verify.checkkinds import Question
from tests.support import ROOT
from tests.support.matrix import LOCAL, MatrixWriter, error_of, line_of

ARITHMETIC = matrix.Arithmetic(questions=50, seed=52148, shots=3, pass_fraction=0.8, max_tokens=16)
LONG = matrix.LongGeneration(prompt="c d e f", tokens=120, max_run=32, window=64, min_distinct=8)

# --- arithmetic ---------------------------------------------------------------------------------

# Each shape read back from its words and solved apart from the generator: the answers are exact.
SOLVERS = [
    (r"has (\d+) \w+ and buys (\d+) bags of (\d+) ", lambda a, b, c: a + b * c),
    (r"has (\d+) \w+ and gives (\d+) to each of (\d+) friends", lambda a, b, c: a - b * c),
    (r"sells (\d+) \w+ on Monday and (\d+) more than that", lambda a, b: 2 * a + b),
    (
        r"keeps (\d+) of (\d+) \w+ and shares the rest among (\d+) friends",
        lambda k, n, f: (n - k) // f if (n - k) % f == 0 else None,
    ),
    (r"reads (\d+) pages a day for (\d+) days, then (\d+) more", lambda a, b, c: a * b + c),
]


def solve(text: str) -> int | None:
    for pattern, solver in SOLVERS:
        found = re.search(pattern, text)
        if found:
            return solver(*map(int, found.groups()))  # type: ignore[no-any-return, operator]
    raise AssertionError(f"no shape reads {text!r}")


def test_the_question_set_is_its_seeds_own_with_exact_answers_and_examples_apart() -> None:
    asked = checkkinds.questions(52148, 200)
    assert len({q.text for q in asked}) == 200
    assert all(solve(q.text) == q.answer and q.answer > 0 for q in asked)
    assert {next(i for i, (p, _) in enumerate(SOLVERS) if re.search(p, q.text)) for q in asked} == set(range(5))
    examples = checkkinds.questions(52148, 3, stream="examples", avoid=asked)
    assert not {q.text for q in examples} & {q.text for q in asked}
    assert checkkinds.questions(52149, 50) != checkkinds.questions(52148, 50)


def test_the_same_seed_gives_the_same_questions_in_another_python_process() -> None:
    """random.Random hashes a string seed with SHA-512 and the draws use random() alone, which Python
    keeps from version to version: the set a runner measured is the set every later run asks."""
    code = "from sparkbuild.verify import checkkinds; print(repr(checkkinds.questions(52148, 50)[-1]))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert other.stdout.strip() == repr(checkkinds.questions(52148, 50)[-1])
    assert checkkinds.questions(52148, 1)[0] == Question(
        "A shop sells 57 coins on Monday and 16 more than that on Tuesday. How many in all?", 130
    )


def test_the_prompt_shows_the_examples_worked_then_asks() -> None:
    prompt = checkkinds.arithmetic_prompt([Question("One plus one?", 2)], Question("Two plus two?", 4))
    assert prompt == "Question: One plus one?\nAnswer: 2\n\nQuestion: Two plus two?\nAnswer:"


@pytest.mark.parametrize(
    ("text", "number"),
    [
        (" 75", 75),
        (" 1,234 pages.", 1234),
        (" -3", -3),
        (" 75\n76", 75),
        ("\n 75", 75),
        (" The answer is 75.", 75),
        (" q r s", None),
    ],
)
def test_the_answer_is_the_first_whole_number_of_its_first_line(text: str, number: int | None) -> None:
    assert checkkinds.number_in(text) == number


def test_the_set_passes_at_its_fraction_and_not_one_below() -> None:
    asked = checkkinds.questions(52148, 50)
    right = [f" {q.answer}" for q in asked]
    forty = checkkinds.judge_arithmetic(ARITHMETIC, asked, [*right[:40], *[" 0"] * 10])
    assert forty.ok and forty.summary == "40/50 right, at least 40 (80%) needed (seed 52148)" and len(forty.wrong) == 10
    below = checkkinds.judge_arithmetic(ARITHMETIC, asked, [*right[:39], *[" 0"] * 11])
    assert not below.ok and below.figures == {"right": 39, "questions": 50, "needed": 40, "seed": 52148}
    assert below.wrong[0].startswith("q40 'Sara has 22 apples") and below.wrong[0].endswith(
        f"expected {asked[39].answer}, answered ' 0'"
    )
    # 0.7 of 10 is 7.000000000000001 in floating point: 7 right must pass all the same.
    ten = asked[:10]
    seven = checkkinds.judge_arithmetic(
        matrix.Arithmetic(questions=10, seed=1, shots=0, pass_fraction=0.7, max_tokens=8), ten, [*right[:7], *[""] * 3]
    )
    assert seven.ok


# --- needles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_a_needle_prompt_fills_the_context_exactly_with_the_needle_at_its_depth(depth: float) -> None:
    head, needle, question = [1], [7, 7, 7], [9, 9]
    filler = list(range(100, 40_000))
    placed = checkkinds.place(
        depth, 12345, head=head, filler=filler, needle=needle, question=question, context=32_768, max_tokens=16
    )
    room = 32_768 - 16 - 1 - 3 - 2
    assert len(placed.ids) + 16 == 32_768
    assert placed.position == 1 + round(depth * room)
    assert list(placed.ids[placed.position : placed.position + 3]) == needle
    assert placed.ids[0] == 1 and list(placed.ids[-2:]) == question
    assert abs(placed.position / 32_768 - depth) < 0.001  # of the served context, within its last 22 tokens
    # Every filler token once, in order, around the needle.
    assert [t for t in placed.ids if t >= 100] == filler[:room]


def test_a_context_with_no_room_for_filler_is_said_with_its_figures() -> None:
    with pytest.raises(VerifyError) as failed:
        checkkinds.place(0.5, 12345, head=[], filler=[], needle=[7] * 60, question=[9] * 40, context=100, max_tokens=8)
    assert "the served context (100 tokens) has no room for filler beside the pass key (60 tokens)" in str(failed.value)


def test_every_key_must_be_found_as_a_whole_number() -> None:
    keys = checkkinds.pass_keys(28, 3)
    assert len(set(keys)) == 3 and all(10_000 <= k <= 99_999 for k in keys) and keys == checkkinds.pass_keys(28, 3)
    placed = [
        checkkinds.Placed(depth=d, key=k, ids=(), position=p)
        for d, k, p in zip((0.1, 0.5, 0.9), keys, (3276, 16380, 29484), strict=True)
    ]
    found = checkkinds.judge_needles(32_768, placed, [f" {k}." for k in keys])
    assert found.ok and found.summary == "3/3 pass keys found, at 10%, 50%, 90% of a 32,768-token context"
    missed = checkkinds.judge_needles(32_768, placed, [f" {keys[0]}.", f" 1{keys[1]}", " !!!!!!!!"])
    assert not missed.ok and missed.figures["found"] == 1
    assert missed.wrong == (
        f"at 50% (token 16,380 of 32,768): expected pass key {keys[1]}, answered ' 1{keys[1]}'",
        f"at 90% (token 29,484 of 32,768): expected pass key {keys[2]}, answered ' !!!!!!!!'",
    )


# --- burn-in ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Said:
    name: str
    expected: str
    received: str

    @property
    def ok(self) -> bool:
        return self.received == self.expected


def test_a_burn_in_passes_only_with_every_answer_right() -> None:
    settings = matrix.BurnIn(requests=6, concurrency=2)
    right = [Said("completion", " g h i j", " g h i j"), Said("chat", " q r s t", " q r s t")] * 3
    assert checkkinds.judge_burn_in(settings, right).ok
    sixth = [*right[:5], Said("chat", " q r s t", "!!!!")]
    failed = checkkinds.judge_burn_in(settings, sixth)
    assert not failed.ok and failed.summary == "5/6 answers right, 2 at a time"
    assert failed.wrong == ("request 6 of 6 (chat): expected ' q r s t', received '!!!!'",)


def test_a_burn_in_asks_each_prompt_in_turn_and_names_the_request_that_failed() -> None:
    prompts = (
        matrix.Prompt(name="a", api="completions", prompt="c d e f", expect=" g h i j", max_tokens=4),
        matrix.Prompt(name="b", api="chat", prompt="m n o p", expect=" q r s t", max_tokens=4),
    )
    asked: list[str] = []

    def ask(prompt: matrix.Prompt) -> Said:
        asked.append(prompt.name)
        if len(asked) == 5:
            # A fault injected: no server fails on its fifth request on purpose (the real one would).
            raise VerifyError(f"{prompt.name}: POST /v1/completions failed: 500", request={"status": 500})
        return Said(prompt.name, prompt.expect, prompt.expect)

    assert checkkinds.burn_in(matrix.BurnIn(requests=4, concurrency=1), prompts, ask).ok
    assert asked == ["a", "b", "a", "b"]
    with pytest.raises(VerifyError) as failed:
        checkkinds.burn_in(matrix.BurnIn(requests=2, concurrency=1), prompts, ask)
    assert str(failed.value) == "burn_in request 1 of 2: a: POST /v1/completions failed: 500"
    assert failed.value.request == {"status": 500}


# --- long generation ----------------------------------------------------------------------------

ALPHABET_IDS = [258 + (6 + i) % 26 for i in range(120)]  # " g h ... z a b ...": the served answer's ids


def text_of(ids: object) -> str:
    return "".join("!" if t == 0 else f"<{t}>" for t in ids)  # type: ignore[attr-defined]


def test_the_alphabets_period_26_cycle_is_not_degenerate() -> None:
    """26 different tokens, each once a period: no run, and every window of 64 holds all 26."""
    outcome = checkkinds.judge_long_generation(LONG, ALPHABET_IDS, "length", text_of)
    assert outcome.ok, outcome.wrong
    assert outcome.figures == {"tokens": 120, "longest_run": 1, "fewest_distinct": 26, "finish_reason": "length"}
    assert checkkinds.period(ALPHABET_IDS) == 26


def test_a_run_of_token_0_is_degenerate() -> None:
    ids = [*ALPHABET_IDS[:70], *[0] * 50]
    outcome = checkkinds.judge_long_generation(LONG, ids, "length", text_of)
    assert not outcome.ok
    # Every window of 64 still holds 15 different tokens or more: the run rule alone catches it.
    assert outcome.wrong == ("token 0 ('!') 50 times in a row from token 71 (at most 32)",)
    assert outcome.figures["fewest_distinct"] == 15


@pytest.mark.parametrize("loop", [[5], [5, 6], [5, 6, 7, 8, 9, 10, 11]])
def test_a_short_loop_is_degenerate_where_a_run_rule_alone_would_pass_it(loop: list[int]) -> None:
    ids = [*ALPHABET_IDS[:30], *(loop * 90)[:90]]
    outcome = checkkinds.judge_long_generation(LONG, ids, "length", text_of)
    assert not outcome.ok
    (why,) = [w for w in outcome.wrong if w.startswith("tokens ")]
    assert f"a loop of {len(loop)} token(s), {text_of(loop)!r}" in why
    assert outcome.figures["fewest_distinct"] == len(loop)


def test_a_loop_of_eight_different_tokens_or_more_is_not_judged() -> None:
    """The rule's edge: a loop of min_distinct tokens or more is text the rule cannot tell from a
    model's content (the alphabet is one); docs/check-kinds.md says what that leaves to the runner."""
    ids = [*ALPHABET_IDS[:30], *(list(range(5, 13)) * 12)[:90]]
    assert checkkinds.judge_long_generation(LONG, ids, "length", text_of).ok


def test_a_generation_that_ends_early_checked_nothing_past_its_end() -> None:
    outcome = checkkinds.judge_long_generation(LONG, ALPHABET_IDS[:90], "stop", text_of)
    assert not outcome.ok
    assert outcome.wrong == (
        "the text ended after 90 of 120 tokens (finish_reason 'stop'): nothing past that was checked; "
        "give long_generation a prompt that asks for more",
    )


def test_distinct_tokens_per_window_slide_one_token_at_a_time() -> None:
    assert checkkinds.distinct_per_window([1, 1, 2, 3, 3, 3], 3) == [2, 3, 2, 1]
    assert checkkinds.distinct_per_window([1, 2], 64) == [2]
    assert checkkinds.longest_run([4, 1, 1, 1, 2, 2]) == checkkinds.Run(token=1, start=1, length=3)
    assert checkkinds.period([1, 2, 1, 2, 1]) == 2 and checkkinds.period([1, 2, 3]) is None


# --- verify's result and error ------------------------------------------------------------------


def test_a_failed_kind_fails_the_result_and_its_error_names_the_kind_the_item_and_the_figure(tmp_path: Path) -> None:
    asked = checkkinds.questions(52148, 50)
    arithmetic = checkkinds.judge_arithmetic(ARITHMETIC, asked, [" 0"] * 50)
    long = checkkinds.judge_long_generation(LONG, ALPHABET_IDS, "length", text_of)
    answer = verify.Answer(name="c", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j")
    result = verify.VerifyResult(
        image="img", model="m", check="gpt-oss-120b", startup_s=1.0, answers=(answer,), kinds=(arithmetic, long)
    )
    assert not result.ok
    data = result.to_json()
    assert data["ok"] is False
    assert [(k["kind"], k["ok"], len(k["wrong"])) for k in data["kinds"]] == [
        ("arithmetic", False, 50),
        ("long_generation", True, 0),
    ]
    json.dumps(data)  # as verify.json is written
    with pytest.raises(VerifyError) as failed:
        verify.require(result, tmp_path / "verify.json")
    lines = str(failed.value).splitlines()
    assert lines[0] == "img: check gpt-oss-120b's kinds failed (docs/check-kinds.md):"
    assert lines[1] == "  arithmetic: 0/50 right, at least 40 (80%) needed (seed 52148)"
    assert lines[2] == f"    q1 {asked[0].text[:60] + '...'!r}: expected 130, answered ' 0'"
    assert lines[6] == "    ... and 46 more (verify.json lists them all)"
    assert "long_generation" not in str(failed.value)
    passing = verify.VerifyResult(image="img", model="m", check="c", startup_s=1.0, answers=(answer,), kinds=(long,))
    assert passing.ok and verify.require(passing, tmp_path / "verify.json") is passing
    # The summary's cell says which kinds ran, or which failed.
    assert pipeline.verify_cell(result) == "1/1 answers, kinds FAILED: arithmetic"
    assert pipeline.verify_cell(passing) == "1/1 answers, kinds ok (long_generation)"
    assert pipeline.verify_cell(verify.VerifyResult(image="img", model="m", check="c", startup_s=1.0, answers=(answer,))) == (
        "1/1 answers"
    )


# --- the matrix keys ----------------------------------------------------------------------------

CHECK_WITH = """\
checks:
  alphabet:
    model: alphabet
    prompts:
      - {{name: completion, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}}
    kinds:
{kinds}
bases:
  deb:
    debootstrap: {{suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}}
"""


def with_kinds(write_matrix: MatrixWriter, kinds: str) -> Path:
    return write_matrix(CHECK_WITH.format(kinds=kinds) + LOCAL, with_checks=False)


def test_a_kind_named_takes_the_defaults_for_what_it_does_not_set(write_matrix: MatrixWriter) -> None:
    path = with_kinds(write_matrix, "      needles: {depths: [0.25]}\n      burn_in:\n      long_generation: {}")
    kinds = matrix.load(path).checks["alphabet"].kinds
    assert kinds.named == ("needles", "burn_in", "long_generation")
    assert kinds.arithmetic is None
    assert kinds.needles == matrix.Needles(depths=(0.25,), seed=28, max_tokens=16)
    assert kinds.burn_in == matrix.BurnIn(requests=100, concurrency=8)
    # The long generation continues the check's first completions prompt unless it names its own.
    assert kinds.long_generation == matrix.LongGeneration(prompt="c d e f", tokens=4096, max_run=32, window=64, min_distinct=8)
    assert matrix.load(write_matrix(LOCAL)).checks["alphabet"].kinds == matrix.Kinds()


@pytest.mark.parametrize(
    ("kinds", "at", "message"),
    [
        ("      needle: {}", "needle:", "kinds.needle: unknown key 'needle'. Perhaps you meant 'needles'?"),
        ("      arithmetic: {questions: 50, pass_fraction: 80}", "pass_fraction", "expected a fraction in (0, 1], like 0.8"),
        ("      arithmetic: {seed: -1}", "seed", "arithmetic.seed: expected a whole number (0 or more), got a number (-1)"),
        ("      needles: {depths: [0.1, 1.0]}", "depths", "needles.depths[1]: expected a depth of the context in (0, 1)"),
        ("      needles: {depths: [0.5, 0.5]}", "depths", "needles.depths: name one depth or more, each once"),
        (
            "      burn_in: {requests: 4, concurrency: 8}",
            "burn_in",
            "burn_in.concurrency: 8 at a time never happens in 4 requests",
        ),
        (
            "      long_generation: {window: 4}",
            "window",
            "long_generation.min_distinct: 8 distinct tokens never fit a window of 4",
        ),
        ("      long_generation: {tokens: 0}", "long_generation:", "long_generation.tokens: expected a positive whole number"),
        ("      multi_node: {nodes: 2}", "multi_node", "kinds.multi_node: a check served across nodes names burn_in too"),
        ("      multi_node: {nodes: 1}\n      burn_in: {}", "nodes", "multi_node.nodes: a cluster is 2 nodes or more, got 1"),
        (
            "      multi_node: {}\n      burn_in: {}",
            "multi_node",
            "kinds.multi_node: give a check served across nodes bench: false",
        ),
        (
            "      multi_node: {launch: rays}\n      burn_in: {}",
            "launch",
            "multi_node.launch: 'rays' is not one of vllm, ray. Perhaps you meant 'ray'?",
        ),
    ],
)
def test_a_bad_kind_setting_names_its_file_line_and_key(write_matrix: MatrixWriter, kinds: str, at: str, message: str) -> None:
    path = with_kinds(write_matrix, kinds)
    error = error_of(path)
    assert error.startswith(f"{path}:{line_of(path, at)}: checks.alphabet.kinds."), error
    assert message in error


def test_a_long_generation_of_a_chat_only_check_needs_its_own_prompt(write_matrix: MatrixWriter) -> None:
    body = CHECK_WITH.replace("api: completions", "api: chat").format(kinds="      long_generation: {tokens: 64}")
    path = write_matrix(body + LOCAL, with_checks=False)
    assert f"{path}:{line_of(path, 'long_generation')}: checks.alphabet.kinds.long_generation: give 'prompt:'" in error_of(path)
    own = body.replace("{tokens: 64}", '{tokens: 64, prompt: "a b"}')
    assert matrix.load(write_matrix(own + LOCAL, with_checks=False)).checks["alphabet"].kinds.long_generation is not None


def test_a_check_served_across_nodes_leaves_the_cluster_flags_to_it(write_matrix: MatrixWriter) -> None:
    body = CHECK_WITH.format(kinds="      multi_node: {nodes: 2}\n      burn_in: {}").replace(
        "    model: alphabet\n", "    model: alphabet\n    bench: false\n    serve_args: [--tensor-parallel-size=2, --headless]\n"
    )
    path = write_matrix(body + LOCAL, with_checks=False)
    error = error_of(path)
    assert error.startswith(f"{path}:{line_of(path, 'multi_node')}: checks.alphabet.kinds.multi_node: "), error
    assert "the check's serve_args set --tensor-parallel-size, --headless, which multi_node sets on each node" in error
    own = matrix.load(
        write_matrix(
            body.replace("serve_args: [--tensor-parallel-size=2, --headless]", "serve_args: []") + LOCAL, with_checks=False
        )
    )
    assert own.checks["alphabet"].kinds.multi_node == matrix.MultiNode(nodes=2, launch="vllm")
    ray = body.replace("serve_args: [--tensor-parallel-size=2, --headless]", "serve_args: []").replace(
        "multi_node: {nodes: 2}", "multi_node: {nodes: 2, launch: ray}"
    )
    assert matrix.load(write_matrix(ray + LOCAL, with_checks=False)).checks["alphabet"].kinds.multi_node == matrix.MultiNode(
        nodes=2, launch="ray"
    )
    # With Ray, vLLM's executor is set by the launch too.
    ray_own = ray.replace("serve_args: []", "serve_args: [--distributed-executor-backend, mp]")
    assert "the check's serve_args set --distributed-executor-backend, which multi_node sets" in error_of(
        write_matrix(ray_own + LOCAL, with_checks=False)
    )


def test_the_shipped_real_model_checks_run_every_server_kind_and_the_alphabet_the_two_it_can_answer() -> None:
    checks = matrix.load(ROOT / "matrix.yaml").checks
    for name in ("gpt-oss-120b", "qwen3-30b-a3b-fp8", "qwen3.5-122b-a10b-nvfp4"):
        assert checks[name].kinds.named == matrix.SERVER_KINDS, name
        burn_in = checks[name].kinds.burn_in
        assert burn_in is not None and burn_in.concurrency <= max_num_seqs(checks[name].serve_args), name
    assert checks["alphabet"].kinds.named == ("burn_in", "long_generation")
    long = checks["alphabet"].kinds.long_generation
    assert long is not None and long.prompt == "c d e f" and long.tokens + 4 <= 128  # the prompt's 4 tokens, its context


def max_num_seqs(args: tuple[str, ...]) -> int:
    """The check's --max-num-seqs, or vLLM's default on a GPU (256)."""
    return int(args[args.index("--max-num-seqs") + 1]) if "--max-num-seqs" in args else 256
