"""Scale simulator: bench + bench-engine measurements -> cost model -> simulated synchronous steps
over 8..1024 DP ranks and 4k..64k contexts -> predicted bubble ratio and BubbleSpec speedup."""
