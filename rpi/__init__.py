"""Deployment on Raspberry Pi-class boards and one-machine cluster emulation. Installed as halo.rpi."""
