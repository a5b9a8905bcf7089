"""Integrations with other packages (TensorBoard, PyTorch Lightning, Hugging Face transformers).

Each module imports its package when it is used, never when nanscan is imported: none of them is a
dependency of nanscan. Install the extra named in each module's error message (``nanscan[lightning]``,
``nanscan[transformers]``, ``nanscan[tensorboard]``).
"""
