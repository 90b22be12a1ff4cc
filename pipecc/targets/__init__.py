"""What the code runs on: the device and link catalog with sources (`devices`, data in
`data/devices.toml`), and the FPGA cost model (`fpga_model`) with its layer rules
(`fpga_layers`)."""
