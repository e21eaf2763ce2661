"""What may be sampled: grammar masks (llguidance) and the repetition / presence / frequency penalties. Imports the
contract and the sampling room.
"""
