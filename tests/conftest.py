import os
import sys

# third_party/ holds model code standing in for a user's project (the `testr` package); d2export never imports it
_THIRD_PARTY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party")
if _THIRD_PARTY not in sys.path:
    sys.path.insert(0, _THIRD_PARTY)
