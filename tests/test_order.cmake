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

# Tests that mostly wait (a peer stopped or missing until a timeout, a stall of seconds, a
# process given its grace, a fault-tolerant job's replica away) or run one small process at a
# time: alone on the 2-core EPYC each used less than 0.9 of a core on average (CPU time over
# wall time, measured one test at a time; 2-88%). Two of them side by side, or one beside a test
# of about one core, left cores idle: 44 of the 318 CPU-seconds of a 159 s suite (ctest -j2)
# with 16 of them under this lock. One lock keeps them apart, so that each waits beside a test
# that computes: about 57 s of them in all, one after the other.
set(_fsdp_waiting_tests
    FaultTolerance.AJoinerWhoseTensorsDifferInLayoutIsRefusedBeforeAnyCopy
    FaultTolerance.ARankKilledBeforeItsVoteFailsTheStepForAll
    FaultTolerance.AReplicaDyingInItsStateCopyIsDroppedAndJoinsWhenRestartedAgain
    FaultTolerance.AReplicaKilledInBackwardDropsOutAndTheRestEqualTheScheduleRun
    FaultTolerance.AReplicaOfTwoRanksRestartedAfterAKillRejoinsAndEqualsTheScheduleRun
    FaultTolerance.ASpareNeverNeededEndsWithTheJob
    FaultTolerance.ASpareTakesTheDeadReplicasPlaceAndEqualsTheScheduleRun
    FaultTolerance.AStalledRankIsDroppedAndLeavesWhenItWakes
    FaultTolerance.AStalledReplicaOfTwoRanksRejoinsOnNewGroups
    FaultTolerance.AStalledReplicaRejoinsFromAPeerAndEqualsTheScheduleRun
    FaultTolerance.TheWriterKilledInACheckpointLeavesThePreviousOneAndTheRestSaveOn
    FaultTolerantTraining.AJoinerWhoseModelFileChangedIsRefusedAndTheRestTrainOn
    FaultTolerantTraining.AReplicaTheScheduleTakesBackThatDiedWhileWaitingIsDroppedAgain
    FaultTolerantTraining.ASpareTakesAKilledReplicasPlaceAndTheLossesEqualTheScheduleRun
    FlightRecorder.NamesTheRankThatStalled
    Harness.KillsHungRanksAtTheTimeoutAndLeavesNoProcess
    InstructData.HostileLinesAreRefused
    Launcher.TheRankThatFailedFirstIsShownFirstAndNamedLast
    ProcessGroup.MissingRankFailsTheRendezvousWithoutHanging
    ProcessGroup.MissingRankWhenRankZeroHostsTheStore
    ProcessGroup.MissingRankZeroMeansNoStore
    ProcessGroup.SilentPeerMakesTheCollectiveTimeOut
    ProcessGroup.UnreachableStoreFailsWithinTheTimeout
    ShardedCheckpoint.AsyncSaveKilledMidWriteLeavesThePreviousOne
    StepProfiler.LateRankShowsAsWaitOnTheOthersAndWhereItWasLate
    TorchrunAgent.EndedBySigtermOrAfterTheGraceBySigkill
    TrainerRun.AsyncCheckpointsEqualSynchronousOnes
    TrainerRun.BindCoresGivesEachLocalRankItsOwnCpus)
set_tests_properties(${_fsdp_waiting_tests} PROPERTIES RESOURCE_LOCK waiting)
