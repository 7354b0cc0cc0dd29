"""Tools on top of the training framework (plan, ...): they import framework; framework never imports them."""
