"""``python -m dspark_hf.training``: the training command (:mod:`dspark_hf.training.train_cli`)."""

from .train_cli import main

if __name__ == "__main__":
    main()
