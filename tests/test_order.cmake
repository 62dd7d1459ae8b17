# Read by CTest after the discovered tests (tests/CMakeLists.txt): orderings between them.
#
# FsdpPlan.AutoChoosesAConfigurationThatFits plans with the machine profile that
# FsdpPlan.AutoMeasuresTheMachineOnceAndReusesIt measures and saves (in tests/work/plan-cache):
# after it, it finds the profile and plans in about a second; beside it (CTest -j2), both measured
# the machine, about 20 s each on the 2-core EPYC. Run alone, the first still runs before it.
set_tests_properties(FsdpPlan.AutoMeasuresTheMachineOnceAndReusesIt PROPERTIES
                     FIXTURES_SETUP machine_profile)
set_tests_properties(FsdpPlan.AutoChoosesAConfigurationThatFits PROPERTIES
                     FIXTURES_REQUIRED machine_profile)

# Tests that mostly wait (a peer stopped or missing until a 2-3 s timeout, a stall of several
# seconds, a process given its grace): alone on one core, each used 11-48% of it (CPU time over
# wall time, measured one test at a time). Two of them side by side left both cores idle, 14-16%
# of the suite's phase (ctest -j2); one lock keeps them apart, so that each waits beside a test
# that computes.
set(_fsdp_waiting_tests
    FaultTolerance.AStalledRankIsDroppedAndLeavesWhenItWakes
    FaultTolerance.AStalledReplicaRejoinsFromAPeerAndEqualsTheScheduleRun
    FaultTolerance.AStalledReplicaOfTwoRanksRejoinsOnNewGroups
    FaultTolerance.AReplicaOfTwoRanksLosingOneInForwardDropsOutWhole
    FaultTolerance.ARankKilledBeforeItsVoteFailsTheStepForAll
    FaultTolerance.AReplicaKilledInBackwardDropsOutAndTheRestEqualTheScheduleRun
    FaultTolerance.TheWriterKilledInACheckpointLeavesThePreviousOneAndTheRestSaveOn
    FlightRecorder.NamesTheRankThatStalled
    ProcessGroup.UnreachableStoreFailsWithinTheTimeout
    ProcessGroup.MissingRankZeroMeansNoStore
    ProcessGroup.MissingRankWhenRankZeroHostsTheStore
    ProcessGroup.MissingRankFailsTheRendezvousWithoutHanging
    ProcessGroup.SilentPeerMakesTheCollectiveTimeOut
    ShardedCheckpoint.AsyncSaveKilledMidWriteLeavesThePreviousOne
    Harness.KillsHungRanksAtTheTimeoutAndLeavesNoProcess
    TorchrunAgent.EndedBySigtermOrAfterTheGraceBySigkill)
set_tests_properties(${_fsdp_waiting_tests} PROPERTIES RESOURCE_LOCK waiting)
