"""What only the chapter's notebooks need: pictures, tables, the kernel-free explorers (plain
JavaScript in ``static/``), the stage-by-stage trace of one layer, and live measurements."""
