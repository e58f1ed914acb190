"""mmproxy.pipelines: ready DALI pipelines for images and audio."""
