"""What the code runs on: devices, links and their catalog with sources (`devices`, which
re-exports `hardware`, `catalog`, `spec`, `measure`, `catalog_format`; data in
`data/devices.toml`), each device's time and memory model (`timing`: the roofline for CPUs
and GPUs; `fpga_timing` on top of the FPGA cost model `fpga_model` and its layer rules
`fpga_layers`)."""
