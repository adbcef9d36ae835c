"""``python -m rewards NAME`` prints the file to pass to ``--reward.remote_url`` for a registered reward."""

import argparse

from rewards import REWARDS, reward_file

parser = argparse.ArgumentParser(prog="python -m rewards", description=__doc__)
parser.add_argument("name", choices=sorted(REWARDS))
print(reward_file(parser.parse_args().name))
