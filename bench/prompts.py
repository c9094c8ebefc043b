"""Prompts the benchmarks share."""

# 417 tokens once the embedded model's chat template wraps it: a first turn that carries context.
CHAT_PROMPT = (
    "Here are my notes from a week of learning to bake bread. Monday: the dough was too wet "
    "and spread flat; I used 80% hydration with all-purpose flour. Tuesday: lowered to 70%, "
    "better shape but dense crumb; the kitchen was cold, about 17 degrees. Wednesday: added "
    "a longer bulk ferment of five hours, the crumb opened up but the crust was pale. "
    "Thursday: baked in a preheated Dutch oven at 250 degrees for twenty minutes lid on, then "
    "twenty lid off; the crust was finally deep brown. Friday: tried 10% whole wheat, which "
    "drank more water, so I went back up to 74%. Saturday: shaped with more tension and "
    "scored at a shallow angle, and the ear finally opened. Sunday: made two loaves to give "
    "away, one overproofed because I forgot it for an hour. "
) * 2 + "Summarise what I learned, then give me a plan for next week in five short steps."
