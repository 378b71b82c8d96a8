"""Shared test set-up: the tests directory is importable (for reference_quant), runs are single-threaded-safe."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
