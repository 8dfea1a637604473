"""`mars_ray.bench.cpu_share` reads each process's CPU seconds from /proc under the name a reader knows it by:
a busy process shows up with the CPU it spent, under its script's name, not `python`."""

from __future__ import annotations

import subprocess
import sys

from mars_ray.bench.cpu_share import cpu_seconds, spent, title


def test_a_process_is_named_as_its_reader_knows_it():
    assert title(["ray::ServeReplica:mars:bench"]) == "ray::ServeReplica:mars:bench"
    assert title(["VLLM::EngineCore"]) == "VLLM::EngineCore"
    assert title(["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8"]) == (
        "vllm.entrypoints.openai.api_server"
    )
    assert title(["/v/bin/python3.11", "-u", "/site/ray/_private/log_monitor.py", "--x"]) == "log_monitor.py"
    assert title(["/v/bin/python", "/v/bin/mars-ray", "serve"]) == "mars-ray"
    assert title(["/v/bin/python", "-B", "-c", "import x"]) == "python -c"
    assert title(["/usr/bin/raylet", "--flag"]) == "raylet"


def test_the_cpu_a_busy_process_spent_is_counted_under_its_name(tmp_path):
    busy = tmp_path / "busy_for_the_test.py"
    # half a CPU second of work, then a line to say so, then it waits to be read before it exits
    busy.write_text(
        "import sys, time\nstart = time.process_time()\nwhile time.process_time() - start < 0.5:\n    pass\n"
        "print('done', flush=True)\nsys.stdin.read()\n"
    )
    before = cpu_seconds()
    child = subprocess.Popen(
        [sys.executable, str(busy)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "done"
        after = cpu_seconds()
    finally:
        child.communicate("")
    used = spent(before, after)
    assert used["busy_for_the_test.py"] >= 0.45
    assert list(used.values()) == sorted(used.values(), reverse=True)
