import os
import sys

# tests import their fixtures module (hf_fixtures) as a top-level module
sys.path.insert(0, os.path.dirname(__file__))
