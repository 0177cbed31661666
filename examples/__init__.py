"""Worked examples of training with `unified`: one subpackage per task (data, reward, workflow)."""
