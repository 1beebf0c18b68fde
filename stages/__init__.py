"""Data stages. Each module is one stage behind the contract in `stages/base.py`."""
