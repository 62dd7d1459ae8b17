// fsdp-plan: plan_main.cpp is the program (its top says what it does).
#include "plan_main.h"

int main(int argc, char** argv) {
  return fsdp_trainer::plan_main(argc, argv);
}
