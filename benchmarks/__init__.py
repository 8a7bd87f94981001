"""Speed and accuracy figures measured as ratios in one run (``make bench``); results in ``out/bench/``."""
