"""What the 2D (PP x TP) serving tests share: the question they ask ``chat_llama``.

``tests/cli/test_tp_serving.py`` (a TOML cluster on loopback) and
``tests/runtime/agent/test_tp_agents.py`` (the same cluster under agents) both compare the
answer with single-process mlx-lm's greedy answer to it.
"""

QUESTION = "What is the capital of France?"
