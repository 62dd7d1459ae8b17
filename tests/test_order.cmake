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
