"""Benchmarks and load drivers: what measures MARS, never what runs it.

    decode.py    `mars-ray bench decode`: every decoder offline on one checkpoint (and the `bench` command)
    decoders.py  the methods it times, native or on vLLM
    decode_report.py  its rows: speed, tokens per forward, ratios and text against the AR baselines
    forward.py   `mars-ray bench forward`: one cached step's cost against its window
    measure.py   what the offline benchmarks measure with: forward counts, peak memory, the device line
    baseline.py  the HF AR baseline every speed ratio and greedy check is taken against
    client.py    the streaming chat client and request record the load drivers share
    loadtest.py  `python -m mars_ray.bench.loadtest`: served speed at fixed concurrency, with peers
    ramp.py      `python -m mars_ray.bench.ramp`: the load-adaptive tau under a ramp of clients

Nothing in the runtime (`mars_ray/core`, `mars_ray/serve`, `mars_ray/train`) imports from here, so a
benchmark can change without touching what is served or trained (tests/test_layout.py holds that). This
file imports nothing, so importing one driver costs only what that driver needs.
"""
