#!/bin/sh
# The launchers tests/launchers runs, from the distribution's packages (Debian, Ubuntu): OpenMPI's
# mpirun, MPICH's Hydra mpiexec, and Slurm's daemons and clients with munge, its authentication.
# Each MPI keeps its own name beside the other (mpirun.openmpi, mpiexec.mpich); the tier calls them
# by those names. Installing only installs: the tier starts every daemon itself, in a folder of its
# own, and touches none of the system's configuration (a machine whose init system lets packages
# start their services gets Debian's munge service started by the install; the tier does not use it).
#
# Run as root, once per machine (the tier runs it when one of the commands is missing):
#     sh tests/launchers/install.sh
set -eu
PACKAGES="openmpi-bin mpich slurmctld slurmd slurm-client munge"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $PACKAGES
dpkg-query -W -f '${Package} ${Version}\n' $PACKAGES
