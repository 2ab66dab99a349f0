"""The fault matrix (``kvproto chaos``, ``docs/assurance.md``): real processes
behind a fault-injecting proxy (:mod:`.proxy`, :mod:`.cluster`, :mod:`.launch`),
writers and readers that check every byte (:mod:`.workers`), one fault per
cell (:mod:`.cells`), the runner (:mod:`.matrix`) and the judge (:mod:`.verdict`),
with the cells' traces checked by TLC (:mod:`.tracecheck`, ``--trace``)."""
