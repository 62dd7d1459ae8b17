// fsdp-train and fsdp-train-cuda: train_main.cpp is the program (its top says what it does).
#include "train_main.h"

int main(int argc, char** argv) {
  return fsdp_trainer::train_main(argc, argv);
}
