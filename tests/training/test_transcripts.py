"""SFT transcripts for episodes: what is trained on, and that the tokens are the rollout's."""

from tempering.data.tasks import sft_completion
from tempering.envs import EnvContext
from tempering.envs.tool_tasks import generate_tool_tasks
from tempering.inference.chat import chat_format
from tempering.training.sft import encode_transcript
from tempering.training.transcripts import sft_transcripts, transcript_text


def test_a_repair_transcript_trains_only_on_the_fix(tiny, tasks, sandbox):
    _, tokenizer = tiny
    made = sft_transcripts(tasks[0][:60], EnvContext(sandbox, max_turns=3), repair_fraction=1.0, seed=0)
    repairs = [(t, tr) for t, tr in made if len(tr) == 2]
    assert len(repairs) > 20
    task, transcript = repairs[0]
    (wrong, feedback, trained_wrong), (fix, none, trained_fix) = transcript
    assert feedback.startswith("# feedback: ") and none is None
    assert not trained_wrong and trained_fix and fix == sft_completion(task) and wrong != fix
    prompt_ids, ids, mask = encode_transcript(chat_format(tokenizer, "plain"), task.prompt, transcript)
    assert tokenizer.decode(prompt_ids + ids, skip_special_tokens=True) == transcript_text(task, transcript)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert trained == fix


def test_tool_transcripts_show_retries_and_are_all_trained(tiny, sandbox):
    train, _ = generate_tool_tasks(50, 0, seed=1)
    ctx = EnvContext(sandbox, max_turns=8, options={"flaky_failure_rate": 0.9, "flaky_max_failures": 2})
    made = sft_transcripts(train, ctx, seed=0)
    assert len(made) == len(train)
    assert all(all(trained for _, _, trained in tr) for _, tr in made)
    flaky = [tr for t, tr in made if t.domain == "tool_flaky"]
    assert any("unavailable" in (obs or "") or "timeout" in (obs or "") for tr in flaky for _, obs, _ in tr)
    assert all(tr[-1][0].startswith("<answer>") for _, tr in made)
