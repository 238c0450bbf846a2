"""The inference side: the repair agent, the model server, monitoring and alerting.

    repair.py     the agent: the episode driver with a stop rule and an attempt log (`tempering repair`)
    failures.py   the class of a failed attempt (syntax, runtime, wrong answer, timeout, memory, ...)
    backends.py   a local model as the commands use it: engine (`make_engine`), chat format, context
    server.py     `tempering serve`: /v1/chat/completions, /v1/completions, /v1/models, /metrics
    serving.py    one choice of a request as an engine request (stop strings, log-probs, streaming)
    monitor.py    Prometheus metrics, JSON logs, the failure-rate alert rule
    commands.py   the three commands' arguments and set-up

Production failures the agent logs become tasks again through `tempering.data.from_logs`.
"""
