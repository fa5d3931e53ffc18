"""The lifecycle's stages, one module per flow in `flows/` (the flow `flows/X.py` calls `stages/X.py`):

    distill.py         teacher -> traces -> gate -> versioned dataset
    gate.py            a Great Expectations suite over a stored dataset
    sft.py             the SFT policy and its held-out accuracy
    value_pretrain.py  the critic pretrained on the SFT policy's rollouts
    train.py           the RL run (SAO or a baseline), evaluated before and after
    evaluate.py        a checkpoint or model on a benchmark, then the model registry
    style_shift.py     online learning while the style preference flips
    rollout.py         episodes of a policy on the embedded engine (`sao rollout`)
    sweep.py           one config trained with N RL seeds, and the table of how each ended
    pipeline.py        the pipeline's key, parent run and headline numbers

and what they share: recipes.py (what each artifact depends on, and its key) and home.py (the run home, the
artifact store, reuse). Each stage reads and writes the run home and publishes to the store, and is skipped when
its output for the same recipe is already complete there: a re-run flow resumes instead of redoing work.
"""
