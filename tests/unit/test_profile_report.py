"""The profile summary attributes nested py-spy process headers to the innermost process."""

from benchmarks.profile_report import summarize

RAW = "\n".join([
    'process 1:"python fastexp demo";process 2:"python -m services.cli serve generator --port 1";'
    'process 3:"python -c from multiprocessing.spawn import spawn_main";run (vllm/core.py:10);'
    "sched_yield (vllm/distributed/utils.py:46) 150",
    'process 1:"python fastexp demo";process 4:"python -m services.cli serve experience --port 2";'
    "_forward (/work/services/experience/pipeline/maker.py:5);action_log_probs (/work/services/experience/workers/logprobs.py:70) 100",
    'process 1:"python fastexp demo";main (/work/services/demo/job.py:3) 50',
    "not a stack line",
])


def test_samples_go_to_the_innermost_process_named_by_its_service(tmp_path):
    raw = tmp_path / "demo.txt"
    raw.write_text(RAW)
    report = summarize(raw, rate=50)
    assert "| service generator: child process | 3.0 | 50% |" in report
    assert "| service experience | 2.0 | 33% |" in report
    assert "| python fastexp demo | 1.0 | 17% |" in report
    assert "| `sched_yield (vllm/distributed/utils.py)` | 3.0 | 100% |" in report
    assert "| `_forward (services/experience/pipeline/maker.py)` | 2.0 | 100% |" in report
