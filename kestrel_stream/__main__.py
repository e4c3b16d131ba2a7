import sys

from kestrel_stream.cli.main import main

sys.exit(main())
