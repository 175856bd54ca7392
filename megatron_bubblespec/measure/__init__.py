"""Measurement apart from the training core: runs and engines -> benches, plain replay, simulator.

``bench`` (paired BubbleSpec on / off runs against plain vLLM), ``plain_replay`` (the baseline),
``engine_bench`` (engine step costs), ``sim`` (the scale simulator and its calibration). Nothing in
the loop, the engines or the trainer imports from here.
"""
