from .deformable_detr_r50_50ep import dataloader, model, train

model.with_box_refine = True
model.as_two_stage = True

train.output_dir = "./output/deformable_detr_r50_two_stage_50ep"
