"""The command verbs beside the CLI that are not training: dppo.cli parses their arguments and calls one function
of each module here.

    evaluate      `dppo eval MODEL_DIR_OR_CHECKPOINT`: greedy evaluation as training does it
    import_gguf   `dppo import-gguf SRC.gguf OUT_DIR`: a GGUF model file as a plain transformers directory
    data          `dppo data reasoning-gym NAME OUT.parquet`: a reasoning-gym dataset as verl-format parquet
    output        where they write: an output appears whole or not at all, and is replaced only with --force
"""
