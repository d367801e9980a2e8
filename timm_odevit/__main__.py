from .zoo import main

main()
