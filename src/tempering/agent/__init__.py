"""The inference side: the repair agent, the model server, monitoring and alerting.

    repair.py     the agent: write code, run it in the sandbox, feed the error back, retry (`tempering repair`)
    failures.py   the class of a failed attempt (syntax, runtime, wrong answer, timeout, memory, ...)
    backends.py   where completions come from: a local model (`LocalChat`) or an OpenAI-compatible URL
    server.py     `tempering serve`: /v1/chat/completions, /v1/completions, /v1/models, /metrics
    monitor.py    Prometheus metrics, JSON logs, the failure-rate alert rule
    commands.py   the three commands' arguments and set-up

Production failures the agent logs become tasks again through `tempering.data.from_logs`.
"""
