"""The coordinator side of the pipeline: the links to every stage, admission, the prompt into
stage 0, the tokens back, recovery from a lost stage, elastic moves. Runs no stage itself.

See docs/architecture.md for how its parts fit.
"""
