"""The oracle the self-test compares the served path against: recorded contexts, noisy oracle trees and the
replayed drafter.
"""
