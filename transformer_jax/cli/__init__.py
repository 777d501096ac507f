"""What every experiment entry point does the same way: flags and one-line errors
(`entrypoint`), the workdir (`workdir`), the checks before anything is written (`validation`),
the process set-up (`process`: allocator, compilation cache)."""
