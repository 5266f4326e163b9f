import os
import sys

# tests share tiny model builders (tests/tiny_models.py); keep CPU threads modest on small CI machines
sys.path.insert(0, os.path.dirname(__file__))
